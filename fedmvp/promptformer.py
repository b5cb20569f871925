"""The PromptFormer (docs/method.md §3): image patches cross-attend to attribute text features.

Queries are the patch embeddings (after conv1 + positional embedding, before ln_pre,
CLS excluded); keys/values are a Linear(embed -> width) projection of every attribute
sentence feature of the candidate classes. One cross-attention block (no residual
around attention, GEGLU feed-forward with residual), then adaptive average pooling
of the P outputs to m prompt tokens. q/k/v/out are explicit ``nn.Linear`` layers so
peft can target them and ONNX export stays simple.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class PromptFormerConfig:
    """Sizes of a PromptFormer; ``for_clip`` fills them from a backbone."""

    text_dim: int = 512  # CLIP joint embedding (attribute feature size)
    width: int = 768  # vision width d_v: queries and prompt tokens live here
    heads: int = 4
    ff_mult: int = 4  # GEGLU inner width = ff_mult * width
    num_patches: int = 196
    num_prompts: int = 4  # m


class CrossAttention(nn.Module):
    """Multi-head attention with explicit q/k/v/out projections."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by {heads} heads")
        self.heads = heads
        self.to_q = nn.Linear(width, width)
        self.to_k = nn.Linear(width, width)
        self.to_v = nn.Linear(width, width)
        self.to_out = nn.Linear(width, width)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        return x.view(b, n, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, query: torch.Tensor, key_ctx: torch.Tensor, value_ctx: torch.Tensor) -> torch.Tensor:
        q = self.split_heads(self.to_q(query))
        k = self.split_heads(self.to_k(key_ctx)).expand(q.shape[0], -1, -1, -1)
        v = self.split_heads(self.to_v(value_ctx)).expand(q.shape[0], -1, -1, -1)
        attn = torch.softmax((q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5), dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(query.shape)
        return self.to_out(out)


class GEGLUFeedForward(nn.Module):
    """LayerNorm -> Linear(d, 2*ff) -> x * gelu(gate) -> Linear(ff, d)."""

    def __init__(self, width: int, mult: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.proj_in = nn.Linear(width, 2 * mult * width)
        self.proj_out = nn.Linear(mult * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, gate = self.proj_in(self.norm(x)).chunk(2, dim=-1)
        return self.proj_out(hidden * F.gelu(gate))


class CrossAttentionBlock(nn.Module):
    """LN(query), LN(key context), raw value context; attention without residual; FF with residual."""

    def __init__(self, width: int, heads: int, ff_mult: int):
        super().__init__()
        self.norm_query = nn.LayerNorm(width)
        self.norm_context = nn.LayerNorm(width)
        self.attn = CrossAttention(width, heads)
        self.ff = GEGLUFeedForward(width, ff_mult)

    def forward(self, query: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        x = self.attn(self.norm_query(query), self.norm_context(context), context)
        return x + self.ff(x)


def pooling_matrix(num_in: int, num_out: int) -> torch.Tensor:
    """[num_out, num_in] averaging weights equal to adaptive_avg_pool1d's bins (raster order)."""
    weights = torch.zeros(num_out, num_in)
    for i in range(num_out):
        start = (i * num_in) // num_out
        end = -((-(i + 1) * num_in) // num_out)
        weights[i, start:end] = 1.0 / (end - start)
    return weights


class PromptFormer(nn.Module):
    """Patch embeddings + attribute features -> m prompt tokens per image."""

    def __init__(self, config: PromptFormerConfig):
        super().__init__()
        self.config = config
        self.text_proj = nn.Linear(config.text_dim, config.width)
        self.block = CrossAttentionBlock(config.width, config.heads, config.ff_mult)
        self.register_buffer("pool", pooling_matrix(config.num_patches, config.num_prompts), persistent=False)

    def context(self, text_features: torch.Tensor) -> torch.Tensor:
        """[1, C*K, width] keys/values from [C, K, E] (or [N, E]) attribute features."""
        return self.text_proj(text_features.reshape(-1, text_features.shape[-1])).unsqueeze(0)

    def forward(self, patches: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
        """patches [B, P, width] (CLS excluded) -> prompts [B, m, width]."""
        out = self.block(patches, self.context(text_features))
        return torch.einsum("mp,bpd->bmd", self.pool.to(out.dtype), out)
