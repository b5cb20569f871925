"""PromptFormer structure: the paper's exact parameter counts (docs/method.md §3), pooling, shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedmvp.promptformer import PromptFormer, PromptFormerConfig, pooling_matrix


def n_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_vit_b16_counts_match_the_spec():
    pf = PromptFormer(PromptFormerConfig(text_dim=512, width=768, num_patches=196, num_prompts=4))
    assert n_params(pf.block) == 9_451_776
    assert n_params(pf.text_proj) == 393_984
    assert n_params(pf) == 9_845_760


@pytest.mark.parametrize("patches,prompts", [(196, 4), (16, 4), (10, 4), (49, 1), (7, 7)])
def test_pooling_equals_adaptive_average_pooling(patches, prompts):
    x = torch.randn(2, patches, 8)
    expected = F.adaptive_avg_pool1d(x.transpose(1, 2), prompts).transpose(1, 2)
    got = torch.einsum("mp,bpd->bmd", pooling_matrix(patches, prompts), x)
    assert torch.allclose(got, expected, atol=1e-6)


def test_vit_b16_prompt_k_is_mean_of_49_consecutive_patches():
    weights = pooling_matrix(196, 4)
    assert torch.equal(weights[1].nonzero().flatten(), torch.arange(49, 98))


def test_shapes_and_value_path_is_not_normalised():
    torch.manual_seed(0)
    pf = PromptFormer(PromptFormerConfig(text_dim=32, width=64, heads=4, num_patches=16, num_prompts=4))
    patches, text = torch.randn(3, 16, 64), torch.randn(5, 10, 32)
    out = pf(patches, text)
    assert out.shape == (3, 4, 64)
    # The key context is layer-normalised, the value context is not: scaling the attribute features
    # leaves the attention weights (almost) unchanged but scales the values, so the output changes.
    assert not torch.allclose(pf(patches, text * 3.0), out, atol=1e-3)


def test_width_must_divide_heads():
    with pytest.raises(ValueError, match="not divisible"):
        PromptFormer(PromptFormerConfig(text_dim=8, width=10, heads=4, num_patches=4))
