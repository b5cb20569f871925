"""The server's default update rule: deltas weighted by staleness, and (central mode) differential privacy.

``[server] update_rule = "fedavg"`` (``update_rules.py``): the rule of online rounds, buffered versions and
`fedmvp ingest`, applied by ``round_writer.RoundWriter``; docs/method.md §6 and docs/howto/privacy.md. An update is the tensors a client trained (``arrays``) and the tensors it
started from (``base``: the round's global state online; for an update file the LoRA of the round its
bundle was exported from, which the run keeps). With ``t`` the rounds between that base and the state
the update is applied to, and ``s(t) = (1 + t)^(-a)``:

    theta <- theta + eta * sum_i n_i s(t_i) (x_i - base_i) / sum_i n_i

per tensor, over the updates that sent it (a LoRA-only client sends only ``lora.*``; a tensor nobody
sent keeps its value). ``a`` is ``[server] staleness_exponent``, ``eta`` ``[server] server_lr``. With
every update fresh (t = 0, base = theta) and eta = 1 this is FedAvg of the values, and it is computed
as exactly that (``weighted_average``), so a run without stale updates keeps its numbers bit for bit.

``[privacy] mode = "central"``: the LoRA's part of each update is clipped to ``clip_norm`` (L2 over all
its LoRA tensors), the m clipped deltas are averaged with equal weights ``s(t_i) / m`` (example counts
would break the sensitivity bound C / m) and N(0, (z C / m)^2) is added to every coordinate of that
mean before eta scales it. In local mode the senders added the noise; the server's rule is the one above.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedmvp_formats.names import LORA_PREFIX
from fedmvp_formats.privacy import CENTRAL, PrivacyRecord, clip_delta


def weighted_average(replies: list[tuple[dict[str, np.ndarray], float]]) -> dict[str, np.ndarray]:
    """Per-tensor FedAvg weighted by examples over the clients that SENT that tensor.

    LoRA-only clients send only ``lora.*``; full clients send ``promptformer.*``; a tensor
    nobody sent is absent from the result (the caller keeps the previous global value).
    """
    sums: dict[str, np.ndarray] = {}
    weights: dict[str, float] = {}
    for arrays, weight in replies:
        for key, value in arrays.items():
            contribution = np.asarray(value, dtype=np.float64) * weight
            sums[key] = sums[key] + contribution if key in sums else contribution
            weights[key] = weights.get(key, 0.0) + weight
    return {k: (sums[k] / weights[k]).astype(np.float32) for k in sums}


def staleness_weight(staleness: int, exponent: float) -> float:
    """s(t) = (1 + t)^(-a): 1 for a fresh update (FedBuff, Papaya: a = 0.5)."""
    return float((1.0 + staleness) ** (-exponent))


@dataclass
class Update:
    """One accepted update: the tensors it trained (``arrays``), its examples, its staleness and the
    tensors it started from (``base``; None: the state it is applied to, i.e. fresh)."""

    arrays: dict[str, np.ndarray]
    examples: float  # its weight: the examples it counts, capped by the round (count_cap.py)
    staleness: int = 0
    base: dict[str, np.ndarray] | None = None


@dataclass
class Aggregate:
    """What `apply_updates` made: the new values of the tensors sent, and per update what it weighed
    (``weights[i]``: staleness, s(t), weight: the share of its delta that reached theta), and the
    central-DP step's record (None: no central noise)."""

    tensors: dict[str, np.ndarray]
    weights: list[dict[str, Any]]
    privacy: dict[str, Any] | None = None
    clipped: list[float | None] = field(default_factory=list)  # per update: its LoRA delta's norm when clipped
    # per update the rule did not take whole (robust rules: docs/howto/robust.md): its index in the updates,
    # "action" ("dropped", "down-weighted", "clipped"), "reason" (one line) and "weight" (as in ``weights``)
    screened: list[dict[str, Any]] = field(default_factory=list)


def apply_updates(theta: Mapping[str, np.ndarray], updates: Sequence[Update], *, server_lr: float = 1.0,
                  exponent: float = 0.5, privacy: PrivacyRecord | None = None,
                  rng: np.random.Generator | None = None) -> Aggregate:
    """The module's rule over ``updates`` applied to ``theta`` (the tensors they are applied to). ``rng``:
    the central noise's source (default: fresh OS entropy, never a seed an observer could know)."""
    s = [staleness_weight(u.staleness, exponent) for u in updates]
    central = privacy is not None and privacy.mode == CENTRAL
    fresh = all(u.staleness == 0 and u.base is None for u in updates)
    if fresh and server_lr == 1.0 and not central:  # exactly FedAvg (the demo's numbers, bit for bit)
        tensors = weighted_average([(u.arrays, float(u.examples)) for u in updates])
        return Aggregate(tensors, _weights(updates, s, server_lr, None), clipped=[None] * len(updates))
    deltas = [{k: np.asarray(v, np.float64) - np.asarray((u.base if u.base is not None else theta)[k], np.float64)
               for k, v in u.arrays.items()} for u in updates]
    private_keys = {k for d in deltas for k in d if k.startswith(LORA_PREFIX)} if central else set()
    steps = _weighted_steps(deltas, updates, s, exclude=private_keys)
    out = Aggregate({}, _weights(updates, s, server_lr, privacy if central else None))
    out.clipped = [None] * len(updates)
    if private_keys:
        steps |= _central_step(deltas, s, privacy, rng if rng is not None else np.random.default_rng(), out)
    out.tensors = {k: (np.asarray(theta[k], np.float64) + server_lr * step).astype(np.float32)
                   for k, step in steps.items()}
    return out


apply_updates.implements_central_dp = True  # type: ignore[attr-defined]  # update_rules.declares_central_dp


def _weighted_steps(deltas: list[dict[str, np.ndarray]], updates: Sequence[Update], s: list[float],
                    exclude: set[str]) -> dict[str, np.ndarray]:
    """sum_i n_i s_i delta_i / sum_i n_i per tensor, over the updates that sent it."""
    sums: dict[str, np.ndarray] = {}
    totals: dict[str, float] = {}
    for delta, update, weight in zip(deltas, updates, s):
        for key, value in delta.items():
            if key in exclude:
                continue
            part = value * (update.examples * weight)
            sums[key] = sums[key] + part if key in sums else part
            totals[key] = totals.get(key, 0.0) + update.examples
    return {k: sums[k] / totals[k] for k in sums}


def _central_step(deltas: list[dict[str, np.ndarray]], s: list[float], privacy: PrivacyRecord,
                  rng: np.random.Generator, out: Aggregate) -> dict[str, np.ndarray]:
    """The LoRA's step under central DP: sum_i s_i clip(delta_i) / m + N(0, (z C / m)^2)."""
    lora = [(i, {k: v for k, v in d.items() if k.startswith(LORA_PREFIX)}) for i, d in enumerate(deltas)]
    lora = [(i, d) for i, d in lora if d]
    m = len(lora)
    sums: dict[str, np.ndarray] = {}
    for i, delta in lora:
        clipped, norm = clip_delta(delta, privacy.clip_norm)
        out.clipped[i] = norm if norm > privacy.clip_norm else None
        for key, value in clipped.items():
            sums[key] = sums[key] + s[i] * value if key in sums else s[i] * value
    sigma = privacy.noise_multiplier * privacy.clip_norm / m
    out.privacy = {"mode": CENTRAL, "participants": m, "noise_std": sigma,
                   "clipped": sum(out.clipped[i] is not None for i, _ in lora)}
    return {k: v / m + rng.normal(0.0, sigma, size=v.shape) for k, v in sorted(sums.items())}


def _weights(updates: Sequence[Update], s: list[float], server_lr: float,
             central: PrivacyRecord | None) -> list[dict[str, Any]]:
    """Per update: its staleness t, s(t) and its weight, the share of its delta that reaches the global
    tensors it sent (eta n_i s_i / sum n over the updates that sent its tensors; central DP on the
    LoRA: eta s_i / m)."""
    totals: dict[str, float] = {}
    for u in updates:
        for key in u.arrays:
            totals[key] = totals.get(key, 0.0) + u.examples
    m = sum(any(k.startswith(LORA_PREFIX) for k in u.arrays) for u in updates)
    out = []
    for u, weight in zip(updates, s):
        first = min(u.arrays)
        if central is not None and first.startswith(LORA_PREFIX):
            share = server_lr * weight / m
        else:
            share = server_lr * u.examples * weight / totals[first]
        out.append({"staleness": u.staleness, "s": weight, "weight": share})
    return out
