"""A stand-in update rule for the poison benchmark's tests only (never shipped): it drops the update
whose LoRA delta is the largest and averages the rest with FedAvg, so the benchmark's table has a
second rule to compare before the robust rules exist (fedmvp/federated/update_rules.py)."""

from __future__ import annotations

import numpy as np

from fedmvp.federated.aggregate import Aggregate, apply_updates
from fedmvp.federated.update_rules import UPDATE_RULES

NAME = "standin_drop_largest"


def drop_largest(theta, updates, *, server_lr, exponent, privacy) -> Aggregate:
    """FedAvg without the update of the largest delta norm (kept when it is the only one)."""
    def norm(update) -> float:
        base = update.base if update.base is not None else theta
        return float(np.sqrt(sum(float(np.sum((v - base[k]) ** 2)) for k, v in update.arrays.items())))

    dropped = max(range(len(updates)), key=lambda i: norm(updates[i])) if len(updates) > 1 else None
    kept = [u for i, u in enumerate(updates) if i != dropped]
    step = apply_updates(theta, kept, server_lr=server_lr, exponent=exponent, privacy=privacy)
    weights, clipped = list(step.weights), list(step.clipped) or [None] * len(kept)
    if dropped is not None:
        weights.insert(dropped, {"staleness": updates[dropped].staleness, "s": None, "weight": 0.0})
        clipped.insert(dropped, None)
    return Aggregate(step.tensors, weights, step.privacy, clipped)


def register() -> None:
    UPDATE_RULES[NAME] = drop_largest
