"""The FedMVP training objective, written once for the server's model and the device's program.

docs/method.md §5: ``L = CE(logits, y) + alpha * mean(1 - cos(f_prompted(x), f_CLIP(x')))``, x' a
per-sample flipped view, f_CLIP frozen; ``alpha = 0`` turns the consistency term off.

Why here, and why ``functional`` is a parameter: ``fedmvp.model.FedMVP.loss`` (a site) and
``edge_client.train`` (a device, running the bundle's exported program) train the same objective
but may not import each other, and this leaf may not import torch. So the caller passes
``torch.nn.functional`` and its tensors; the formula, its float32 rule and its ``alpha = 0`` rule
live only here.
"""

from __future__ import annotations

from typing import Any


def consistency_on(alpha: float) -> bool:
    """Whether the consistency term counts: a caller computes the frozen targets (an extra forward
    pass, and the flip's random draws) only then."""
    return alpha > 0


def fedmvp_objective(features: Any, logits: Any, frozen: Any | None, labels: Any, alpha: float,
                     functional: Any) -> dict[str, Any]:
    """``{"loss", "ce", "consistency"}`` of one batch (docs/method.md §5).

    ``features``: normalised prompted image features [B, E]; ``logits`` [B, C]; ``frozen``: the
    frozen CLIP features of the flipped views [B, E] (unused, may be None, when ``alpha`` is 0);
    ``functional``: ``torch.nn.functional``. Both terms in float32, so autocast's bf16/fp16 never
    reaches the loss (under autocast, cross-entropy and cosine similarity run in float32 anyway).
    With ``alpha`` 0 the consistency is a float32 zero and the loss equals the cross-entropy."""
    ce = functional.cross_entropy(logits.float(), labels)
    if not consistency_on(alpha):
        consistency = ce.new_zeros(())
    elif frozen is None:
        raise ValueError(f"alpha {alpha}: the consistency term needs the frozen targets")
    else:
        consistency = (1 - functional.cosine_similarity(features.float(), frozen.float(), dim=-1)).mean()
    return {"loss": ce + alpha * consistency, "ce": ce, "consistency": consistency}
