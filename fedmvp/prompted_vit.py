"""open_clip's VisionTransformer forward, split so prompt tokens can be injected (docs/method.md §3).

`PromptedVisionTransformer` subclasses open_clip's ``VisionTransformer`` and adds two steps, so the
prompted forward uses the ViT's own members from inside the class instead of reaching into them
from outside:
- ``embed_patches``: open_clip's ``_embeds`` up to (not including) patch dropout and ``ln_pre``:
  conv1, flatten, [CLS] + patches, + positional embedding;
- ``encode_embedded``: prompts appended after that WITHOUT positional embedding, then open_clip's
  patch dropout, ``ln_pre``, the frozen transformer, its own pooling (``_pool``) and projection.
With no prompts this is exactly ``visual(x)``. The subclass adds methods only (no state, no
override), so a loaded ViT is re-typed in place (`prompted`): same weights, same ``forward``.
"""

from __future__ import annotations

import torch
from open_clip.transformer import VisionTransformer


class PromptedVisionTransformer(VisionTransformer):
    """open_clip's ViT plus the two halves of its forward that prompt injection needs."""

    def embed_patches(self, images: torch.Tensor) -> torch.Tensor:
        """[B, 1 + P, width]: CLS + patch embeddings with positional embedding, before patch dropout."""
        x = self.conv1(images)
        x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
        cls = self.class_embedding.to(x.dtype).view(1, 1, -1).expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1)
        return x + self.positional_embedding.to(x.dtype)

    def encode_embedded(self, tokens: torch.Tensor, prompts: torch.Tensor | None = None) -> torch.Tensor:
        """Unnormalised image feature from ``embed_patches`` output, with prompt tokens appended."""
        if prompts is not None and prompts.shape[1] > 0:
            tokens = torch.cat([tokens, prompts.to(tokens.dtype)], dim=1)
        x = self.ln_pre(self.patch_dropout(tokens))
        pooled, _ = self._pool(self.transformer(x))
        return pooled @ self.proj if self.proj is not None else pooled


def prompted(visual: VisionTransformer) -> PromptedVisionTransformer:
    """``visual`` as a `PromptedVisionTransformer` (the same object; done once, before any tracing).

    Why in place: open_clip builds the model; the subclass only adds methods, so the weights, the
    state-dict names and open_clip's own ``forward`` stay exactly what they were."""
    if isinstance(visual, PromptedVisionTransformer):
        return visual
    if type(visual) is not VisionTransformer:
        raise TypeError(f"prompt injection needs open_clip's VisionTransformer, not {type(visual).__name__}")
    visual.__class__ = PromptedVisionTransformer
    return visual


def patch_embeds(visual: VisionTransformer, images: torch.Tensor) -> torch.Tensor:
    """[B, 1 + P, width]: CLS + patch embeddings with positional embedding, before ln_pre."""
    return prompted(visual).embed_patches(images)


def encode_tokens(visual: VisionTransformer, tokens: torch.Tensor,
                  prompts: torch.Tensor | None = None) -> torch.Tensor:
    """Unnormalised image feature from embedded tokens, with prompt tokens appended."""
    return prompted(visual).encode_embedded(tokens, prompts)


def encode_image_prompted(visual: VisionTransformer, images: torch.Tensor,
                          prompts: torch.Tensor | None = None) -> torch.Tensor:
    """Same as ``visual(images)`` when ``prompts`` is None or has zero tokens."""
    visual = prompted(visual)
    return visual.encode_embedded(visual.embed_patches(images), prompts)
