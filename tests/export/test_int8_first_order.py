"""The first-order int8 sensitivity on the tiny edge model: it matches a real quantisation of one
layer, ranks a layer made fragile first, and the prediction keeps what the estimate says."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from export.int8 import predict_kept, rank_first_order
from export.int8_sensitivity import fake_quant_activation, fake_quant_weight, first_order_shifts, weight_key

IMAGES = 6


@pytest.fixture(scope="module")
def edge():
    from export.class_set import ClassSet, text_features
    from export.edge_module import build_edge_classifier
    from fedmvp.clip import load_clip
    from fedmvp.model import FedMVP

    torch.manual_seed(0)
    clip = load_clip("fedmvp-tiny", None)
    model = FedMVP(clip)
    names = [f"class_{i}" for i in range(5)]
    classes = ClassSet(names=names, attributes={n: [f"shape {i}", f"colour {i}"] for i, n in enumerate(names)})
    features = text_features(clip, classes)
    model.set_text_features(features)
    return build_edge_classifier(model, features)


@pytest.fixture(scope="module")
def images(edge) -> torch.Tensor:
    size = edge.visual.image_size
    size = size[0] if isinstance(size, tuple) else size
    return torch.randn(IMAGES, 3, size, size, generator=torch.Generator().manual_seed(3))


def margins(logits: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(len(logits))
    return logits[rows, order[:, 0]] - logits[rows, order[:, 1]]


@torch.no_grad()
def real_shift(edge, images: torch.Tensor, layer: torch.nn.Linear) -> np.ndarray:
    """Margin change per image when ``layer`` alone computes fq(x) @ fq(W^T), each image on its own
    (a batch of one: the activation range is the image's)."""
    base = torch.cat([edge(image[None])[0] for image in images])
    order = torch.topk(base, 2, dim=-1).indices
    quantized = fake_quant_weight(layer.weight.t())
    handle = layer.register_forward_hook(
        lambda module, args, out: fake_quant_activation(args[0]) @ quantized + module.bias)
    try:
        shifted = torch.cat([edge(image[None])[0] for image in images])
    finally:
        handle.remove()
    return (margins(shifted, order) - margins(base, order)).numpy()


def test_the_estimate_is_the_real_margin_shift_of_one_quantised_layer(edge, images):
    layer = edge.visual.transformer.resblocks[-1].mlp.c_fc
    estimate = first_order_shifts(edge, images, batch=1)[weight_key(layer.weight.detach().t().numpy())]
    real = real_shift(edge, images, layer)
    assert np.corrcoef(estimate, real)[0, 1] > 0.9
    assert np.abs(estimate).sum() == pytest.approx(np.abs(real).sum(), rel=0.3)


def test_every_weight_matmul_is_estimated_and_a_fragile_one_ranks_first(edge, images):
    block = edge.visual.transformer.resblocks[0]
    fc = block.mlp.c_fc
    saved = {p: p.detach().clone() for p in (fc.weight, block.ln_2.weight, block.ln_2.bias)}
    try:
        with torch.no_grad():  # input channel 0 is always 0: a huge weight there changes no output,
            block.ln_2.weight[0] = block.ln_2.bias[0] = 0.0  # only every output channel's int8 scale
            fc.weight[:, 0] = 1e3 * fc.weight.abs().max()
        fragile = weight_key(fc.weight.detach().t().numpy())
        shifts = first_order_shifts(edge, images)
    finally:
        with torch.no_grad():
            for param, value in saved.items():
                param.copy_(value)
    blocks = len(edge.visual.transformer.resblocks)
    # per block: MHA in-projection (through F.linear), out-projection, c_fc, c_proj; then visual.proj,
    # the PromptFormer's to_q, to_out, two feed-forward linears and the class head; no LoRA matmul
    assert len(shifts) == 4 * blocks + 6
    names = list(shifts)
    ranked = rank_first_order(names, shifts)
    assert ranked[0] == fragile


def test_prediction_keeps_the_layers_whose_summed_shift_would_flip_a_margin():
    gaps = np.array([1.0, 2.0, 3.0, 4.0])
    reference = np.stack([gaps, np.zeros(4)], axis=1)  # top-1 margin = gaps
    shifts = {"big": np.array([1.5, 0.0, 0.0, 0.0]), "medium": np.array([0.0, 0.9, 0.0, 0.0]),
              "small": np.array([0.01, 0.01, 0.01, 0.01])}
    ranked = rank_first_order(list(shifts), shifts)
    assert ranked == ["big", "medium", "small"]
    assert predict_kept(ranked, shifts, reference, 1.0) == 1  # "big" flips image 0; the rest stay below every gap
    assert predict_kept(ranked, shifts, reference, 0.5) == 0
    partial = {"medium": shifts["medium"]}
    ranked = rank_first_order(list(shifts), partial)
    assert ranked == ["big", "small", "medium"]  # no estimate: nothing says they are safe
    assert predict_kept(ranked, partial, reference, 1.0) == 2
