"""The .pt2 training program: loads without the training core, matches PyTorch, trains LoRA only."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F
from export_helpers import NUM_CLASSES, rebuilt_model
from safetensors.torch import load_file

from edge_client.bundle import read_bundle, verify_program_archive


def _load(bundle_path):
    bundle = read_bundle(bundle_path)  # hashes verified before torch sees the archive
    verify_program_archive(bundle.file("training"))
    program = torch.export.load(str(bundle.file("training"))).module()
    assert bundle.manifest["training"]["dict_keys"] == "sorted"
    weights, lora = load_file(str(bundle.file("weights"))), load_file(str(bundle.file("lora")))
    return bundle, program, dict(sorted(weights.items())), dict(sorted(lora.items()))


def test_autograd_reaches_only_lora(tiny_bundle):
    _, program, weights, lora = _load(tiny_bundle.path)
    assert list(program.parameters()) == [] and list(program.buffers()) == []  # stores no tensors of its own
    lora = {k: v.clone().requires_grad_(True) for k, v in lora.items()}
    images = torch.randn(4, 3, 32, 32)
    features, logits, frozen = program(images, images.flip(-1), lora, weights)
    assert features.shape == (4, 128) and logits.shape == (4, NUM_CLASSES) and frozen.shape == (4, 128)
    loss = F.cross_entropy(logits, torch.tensor([0, 1, 2, 3])) \
        + 10 * (1 - F.cosine_similarity(features, frozen, dim=-1)).mean()
    loss.backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in lora.values())
    assert all(not w.requires_grad and w.grad is None for w in weights.values())


def test_frozen_features_carry_no_gradient(tiny_bundle):
    _, program, weights, lora = _load(tiny_bundle.path)
    lora = {k: v.clone().requires_grad_(True) for k, v in lora.items()}
    _, _, frozen = program(torch.randn(2, 3, 32, 32), torch.randn(2, 3, 32, 32), lora, weights)
    assert not frozen.requires_grad


def test_program_matches_pytorch_and_onnx(tiny_bundle, tiny_run):
    bundle, program, weights, lora = _load(tiny_bundle.path)
    model, _ = rebuilt_model(tiny_run)
    images = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        features, logits, frozen = program(images, images, lora, weights)
        np.testing.assert_allclose(logits.numpy(), model(images).numpy(), atol=1e-4)
        np.testing.assert_allclose(frozen.numpy(), model.encode_frozen(images).numpy(), atol=1e-5)
    session = ort.InferenceSession(str(bundle.file("onnx")), providers=["CPUExecutionProvider"])
    onnx_logits, _, onnx_embeds = session.run(None, {"pixel_values": images.numpy()})
    np.testing.assert_allclose(onnx_logits, logits.numpy(), atol=1e-4)
    np.testing.assert_allclose(onnx_embeds, features.numpy(), atol=1e-5)


def test_a_few_sgd_steps_lower_the_loss(tiny_bundle):
    _, program, weights, lora = _load(tiny_bundle.path)
    lora = {k: v.clone().requires_grad_(True) for k, v in lora.items()}
    images, labels = torch.randn(12, 3, 32, 32, generator=torch.Generator().manual_seed(5)), torch.arange(12) % NUM_CLASSES
    optimizer = torch.optim.SGD(lora.values(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        _, logits, _ = program(images, images, lora, weights)
        loss = F.cross_entropy(logits, labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
