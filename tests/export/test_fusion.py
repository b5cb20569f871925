"""The fp32 ONNX graph carries ONNX Runtime's fused transformer ops, links every weight into the
weights file, and still takes a LoRA given at session creation (tiny random-init model, seconds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_client.runtime import make_session
from export import onnx_export
from export.edge_module import build_edge_classifier, model_lora
from fedmvp.clip import load_clip
from fedmvp.model import FedMVP

ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def tiny():
    """(model, features, clip) with random weights and 5 classes x 3 attributes."""
    torch.manual_seed(0)
    clip = load_clip("fedmvp-tiny", None)
    model = FedMVP(clip)
    features = torch.nn.functional.normalize(torch.randn(5, 3, clip.embed_dim), dim=-1)
    model.set_text_features(features)
    return model, features, clip


def _export(edge, clip, tmp_path):
    """Fused fp32 model.onnx reading its frozen weights from weights.safetensors, as a bundle has it."""
    from safetensors.torch import save_file

    weights = tmp_path / "weights.safetensors"
    save_file({k: v.detach().contiguous() for k, v in edge.frozen_tensors().items()}, str(weights))
    proto = onnx_export.to_proto(onnx_export.fused(onnx_export.export_ir(edge, clip.image_size)))
    onnx_export.link_external(proto, weights)
    onnx_export.save(proto, tmp_path / "model.onnx")
    onnx_export.check(tmp_path / "model.onnx")
    return proto


def test_fused_graph_keeps_links_and_lora_override(tiny, tmp_path):
    model, features, clip = tiny
    edge = build_edge_classifier(model, features)
    proto = _export(edge, clip, tmp_path)
    blocks = len(clip.model.visual.transformer.resblocks)
    ops = onnx_export.fused_ops(proto)
    assert ops.get("MultiHeadAttention") == blocks, ops
    assert ops.get("SkipLayerNormalization", 0) >= 2 * blocks - 1, ops
    assert ops.get("BiasGelu") == blocks, ops
    assert not [n for n in proto.graph.node if n.op_type == "Erf"]
    frozen = set(edge.frozen_tensors())
    assert frozen & {i.name for i in proto.graph.initializer} <= onnx_export.external_names(proto)
    assert set(edge.lora_names) <= {i.name for i in proto.graph.input}

    images = torch.randn(3, 3, clip.image_size, clip.image_size)
    lora = {k: v + 0.05 * torch.randn_like(v) for k, v in model_lora(model).items()}
    other = build_edge_classifier(model, features, lora=lora)
    with torch.no_grad(), onnx_export.no_mha_fastpath():
        want, want_other = edge(images)[0].numpy(), other(images)[0].numpy()
    session, _ = make_session(tmp_path / "model.onnx", "cpu", threads=1)
    got = session.run(["logits"], {"pixel_values": images.numpy()})[0]
    np.testing.assert_allclose(got, want, atol=1e-4)
    swapped, _ = make_session(tmp_path / "model.onnx", "cpu", threads=1,
                              initializers={k: v.numpy() for k, v in lora.items()})
    got_other = swapped.run(["logits"], {"pixel_values": images.numpy()})[0]
    assert np.abs(want_other - want).max() > 1e-3
    np.testing.assert_allclose(got_other, want_other, atol=1e-4)


def test_plain_visual_matches_open_clip(tiny, tmp_path):
    """The unprompted encoder that benchmarks compare against: fused, and open_clip's numbers."""
    _, _, clip = tiny
    ops = onnx_export.export_plain_visual(clip.model.visual, clip.image_size, tmp_path / "plain.onnx")
    assert ops.get("MultiHeadAttention") == len(clip.model.visual.transformer.resblocks), ops
    images = torch.randn(2, 3, clip.image_size, clip.image_size)
    with torch.no_grad(), onnx_export.no_mha_fastpath():
        want = clip.model.visual(images).numpy()
    session, _ = make_session(tmp_path / "plain.onnx", "cpu", threads=1)
    got = session.run(["image_embeds"], {"pixel_values": images.numpy()})[0]
    np.testing.assert_allclose(got, want, atol=1e-4)
