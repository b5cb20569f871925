"""fedmvp_formats, the shared leaf: the PromptFormer digest (one definition for server, exporter and device)
and the FedMVP objective (one definition for the server's model and the device's training program)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedmvp_formats.promptformer import promptformer_digest


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"promptformer.text_proj.bias": rng.standard_normal(8).astype(np.float32),
            "promptformer.block.attn.to_k.weight": rng.standard_normal((8, 8)).astype(np.float32),
            "lora.block.attn.to_q.lora_A.weight": rng.standard_normal((4, 8)).astype(np.float32)}


def test_the_digest_covers_promptformer_names_shapes_and_bytes_only():
    state = _state()
    digest = promptformer_digest(state)
    assert digest == promptformer_digest({k: v for k, v in state.items() if k.startswith("promptformer.")})
    assert digest == promptformer_digest({k: v.astype(np.float64) for k, v in state.items()})  # float32 bytes
    moved = {**state, "promptformer.text_proj.bias": state["promptformer.text_proj.bias"] + 1e-3}
    assert promptformer_digest(moved) != digest
    reshaped = {**state, "promptformer.text_proj.bias": state["promptformer.text_proj.bias"].reshape(1, -1)}
    assert promptformer_digest(reshaped) != digest  # the shape is part of it
    renamed = {k.replace("text_proj", "text_proj2"): v for k, v in state.items()}
    assert promptformer_digest(renamed) != digest


# ---- the FedMVP objective (docs/method.md §5), the one the server's model and the device's program train ----
def test_the_objective_is_cross_entropy_alone_when_alpha_is_zero():
    import torch
    import torch.nn.functional as F

    from fedmvp_formats.objective import consistency_on, fedmvp_objective

    logits = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.2, 3.0]])
    labels = torch.tensor([0, 1])
    features = F.normalize(torch.randn(2, 4, generator=torch.Generator().manual_seed(0)), dim=-1)
    out = fedmvp_objective(features, logits, None, labels, 0.0, F)  # no frozen targets needed
    assert not consistency_on(0.0) and consistency_on(1e-3)
    assert torch.equal(out["loss"], out["ce"]) and torch.equal(out["ce"], F.cross_entropy(logits, labels))
    assert out["consistency"].dtype == torch.float32 and float(out["consistency"]) == 0.0
    ignored = fedmvp_objective(features, logits, -features, labels, 0.0, F)  # targets given: still unused
    assert torch.equal(ignored["loss"], out["loss"]) and float(ignored["consistency"]) == 0.0
    with pytest.raises(ValueError, match="frozen targets"):
        fedmvp_objective(features, logits, None, labels, 10.0, F)


def test_the_consistency_term_on_known_vectors():
    import torch
    import torch.nn.functional as F

    from fedmvp_formats.objective import fedmvp_objective

    features = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    frozen = torch.tensor([[1.0, 0.0], [1.0, 0.0], [-1.0, 0.0]])  # cos 1, 0, -1: 1 - cos = 0, 1, 2
    logits = torch.zeros(3, 4)
    labels = torch.tensor([0, 1, 2])
    out = fedmvp_objective(features, logits, frozen, labels, 10.0, F)
    assert float(out["consistency"]) == pytest.approx(1.0)
    assert float(out["ce"]) == pytest.approx(math.log(4))  # uniform logits over 4 classes
    assert float(out["loss"]) == pytest.approx(math.log(4) + 10.0)
    # low precision in, float32 out: autocast's bf16 never reaches the loss
    low = fedmvp_objective(features.bfloat16(), logits.bfloat16(), frozen.bfloat16(), labels, 10.0, F)
    assert all(v.dtype == torch.float32 for v in low.values()) and torch.equal(low["loss"], out["loss"])
