"""A random-init ViT-B-16 bundle exports with TorchScript, and edge-client's TorchScript engine gives ONNX
Runtime's top-1 on its check images (the real architecture: 224 px, 196 patches, 12 blocks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

CHECKED = 8  # check images run through both engines (the exporter's parity already covered 32)


@pytest.mark.slow  # the real ViT-B-16 (random init) exported to ONNX and TorchScript
def test_vit_b16_exports_with_torchscript_and_matches_ort(tmp_path):
    from edge_client.bundle import read_bundle
    from edge_client.infer import Predictor
    from edge_client.runtime_choice import check_images
    from export.bundle_writer import BundleInputs, BundleOptions, write_bundle
    from export.class_set import ClassSet
    from export.run_inputs import synthetic_images
    from fedmvp.clip import load_clip
    from fedmvp.model import FedMVP

    torch.manual_seed(0)
    clip = load_clip("ViT-B-16", None)
    classes = ClassSet(names=["cat", "dog"], attributes={"cat": ["whiskers"], "dog": ["floppy ears"]})
    result = write_bundle(FedMVP(clip), clip, classes, tmp_path / "vitb16-ts", BundleInputs(synthetic_images(32, 224)),
                          BundleOptions(training=False, torchscript=True))
    record = result.parity["torchscript"]
    assert record.passed and record.images == 32 and record.top1_agreement == 1.0
    assert record.max_abs_logit_diff <= 1e-3
    bundle = read_bundle(result.path)
    assert bundle.manifest["torchscript"]["file"] == "model.torchscript.pt"
    assert bundle.manifest["parity"]["torchscript"]["passed"] is True
    pixels = check_images(bundle, CHECKED)
    ort = Predictor(bundle, personalised=False, runtime="ort").run(pixels)["logits"]
    ts = Predictor(bundle, personalised=False, runtime="torchscript").run(pixels)["logits"]
    assert ts.shape == ort.shape == (CHECKED, 2)
    assert (ts.argmax(-1) == ort.argmax(-1)).all() and np.max(np.abs(ts - ort)) <= 1e-3
