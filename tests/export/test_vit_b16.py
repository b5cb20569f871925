"""Export + fp32 parity once on the real ViT-B-16 architecture (random init, 224 px, 196 patches), and
edge-client's TorchScript engine on it: one bundle with both engines, exported once for the module
(the architecture's build and export cost most of its minute)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

CHECKED = 8  # check images run through both engines (the exporter's parity already covered 32)


@pytest.fixture(scope="module")
def vit_b16(tmp_path_factory):
    """(the export's result, its bundle): ONNX with its training program, and TorchScript."""
    from edge_client.bundle import read_bundle
    from export.bundle_writer import BundleInputs, BundleOptions, write_bundle
    from export.class_set import ClassSet
    from export.run_inputs import synthetic_images
    from fedmvp.clip import load_clip
    from fedmvp.model import FedMVP

    torch.manual_seed(0)
    clip = load_clip("ViT-B-16", None)
    model = FedMVP(clip)
    generator = torch.Generator().manual_seed(1)
    model.load_state({k: torch.randn(v.shape, generator=generator) * 0.02
                      for k, v in model.state("lora").items() if "lora_B" in k})
    classes = ClassSet(names=["cat", "dog", "bird"],
                       attributes={"cat": ["whiskers", "pointed ears"], "dog": ["floppy ears", "a wagging tail"],
                                   "bird": ["feathers", "a beak"]})
    result = write_bundle(model, clip, classes, tmp_path_factory.mktemp("vitb16") / "bundle",
                          BundleInputs(synthetic_images(32, 224)), BundleOptions(torchscript=True))
    return result, read_bundle(result.path)


@pytest.mark.slow  # the real ViT-B-16 (random init) exported to ONNX and TorchScript, checked for parity
def test_vit_b16_export_and_parity(vit_b16):
    result, bundle = vit_b16
    fp32 = result.parity["fp32"]
    assert fp32.passed and fp32.images == 32 and fp32.max_abs_logit_diff <= 1e-3 and fp32.top1_agreement == 1.0
    assert bundle.preprocess.image_size == 224 and bundle.lora_shapes["lora.block.attn.to_q.lora_A.weight"] == [8, 768]
    graph = onnx.load(str(result.path / "model.onnx"), load_external_data=False)
    assert graph.opset_import[0].version >= 17
    from export.onnx_export import fused_ops  # ORT's fused transformer ops, one per block
    assert fused_ops(graph) == {"BiasGelu": 12, "Gelu": 1, "MultiHeadAttention": 12, "SkipLayerNormalization": 24}
    # The frozen weights are stored once: the ONNX file only points into weights.safetensors.
    assert result.sizes["model.onnx"] < 5e6 and result.sizes["train.pt2"] < 10e6
    assert result.sizes["weights.safetensors"] > 300e6


@pytest.mark.slow  # shares the module's ViT-B-16 bundle (its first test pays the export)
def test_vit_b16_exports_with_torchscript_and_matches_ort(vit_b16):
    from edge_client.infer import Predictor
    from edge_client.runtime_choice import check_images

    result, bundle = vit_b16
    record = result.parity["torchscript"]
    assert record.passed and record.images == 32 and record.top1_agreement == 1.0
    assert record.max_abs_logit_diff <= 1e-3
    assert bundle.manifest["torchscript"]["file"] == "model.torchscript.pt"
    assert bundle.manifest["parity"]["torchscript"]["passed"] is True
    pixels = check_images(bundle, CHECKED)
    ort = Predictor(bundle, personalised=False, runtime="ort").run(pixels)["logits"]
    ts = Predictor(bundle, personalised=False, runtime="torchscript").run(pixels)["logits"]
    assert ts.shape == ort.shape == (CHECKED, 3)
    assert (ts.argmax(-1) == ort.argmax(-1)).all() and np.max(np.abs(ts - ort)) <= 1e-3
