"""open_clip's VisionTransformer forward, split so prompt tokens can be injected (docs/method.md §3).

``patch_embeds`` is open_clip's ``_embeds`` up to (not including) patch dropout and
``ln_pre``: conv1, flatten, [CLS] + patches, + positional embedding. Prompts are
appended after that WITHOUT positional embedding, then ``ln_pre``, the frozen
transformer and open_clip's own pooling (ln_post on CLS) and projection. With no
prompts this is exactly ``visual(x)``.
"""

from __future__ import annotations

import torch
from open_clip.transformer import VisionTransformer


def patch_embeds(visual: VisionTransformer, images: torch.Tensor) -> torch.Tensor:
    """[B, 1 + P, width]: CLS + patch embeddings with positional embedding, before ln_pre."""
    x = visual.conv1(images)
    x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
    cls = visual.class_embedding.to(x.dtype).view(1, 1, -1).expand(x.shape[0], -1, -1)
    x = torch.cat([cls, x], dim=1)
    return x + visual.positional_embedding.to(x.dtype)


def encode_tokens(visual: VisionTransformer, tokens: torch.Tensor,
                  prompts: torch.Tensor | None = None) -> torch.Tensor:
    """Unnormalised image feature from embedded tokens, with prompt tokens appended."""
    if prompts is not None and prompts.shape[1] > 0:
        tokens = torch.cat([tokens, prompts.to(tokens.dtype)], dim=1)
    x = visual.patch_dropout(tokens)
    x = visual.ln_pre(x)
    x = visual.transformer(x)
    pooled, _ = visual._pool(x)
    if visual.proj is not None:
        pooled = pooled @ visual.proj
    return pooled


def encode_image_prompted(visual: VisionTransformer, images: torch.Tensor,
                          prompts: torch.Tensor | None = None) -> torch.Tensor:
    """Same as ``visual(images)`` when ``prompts`` is None or has zero tokens."""
    return encode_tokens(visual, patch_embeds(visual, images), prompts)
