"""Robust update rules: ``[server] update_rule`` = "norm_clip", "trimmed_mean", "median" or "multi_krum".

Why: FedAvg's mean lets one update move theta as far as it likes (a scaled or sign-flipped delta, an
outlier); these rules bound or outvote such updates (docs/howto/robust.md). Each works on the
*discounted deltas* ``v_i = s(t_i) (x_i - base_i)`` (``aggregate``: s(t) = (1 + t)^(-a)), so staleness
multiplies a delta before any norm, distance or order statistic sees it, and theta <- theta + eta * step:

- ``norm_clip``: B = robust_clip_factor x median_i ||v_i|| (L2 over every tensor the update sent);
  step = sum n_i clip_B(v_i) / sum n_i per tensor over the updates that sent it (FedAvg of clipped deltas).
- ``trimmed_mean``: per coordinate over the m updates that sent the tensor, the k largest and k smallest
  v are dropped, k = floor(trim_fraction m), at least 1 when trim_fraction > 0 and m >= 3, at most
  (m - 1) // 2; step = the plain mean of the rest (example counts are the sender's claim: ignored).
- ``median``: per coordinate, the median of v (examples ignored).
- ``multi_krum``: f = assumed_malicious; score_i = sum of the squared distances from v_i to its
  max(n - f - 2, 1) nearest others (a tensor one of the two did not send counts as a zero delta); the
  max(n - f, 1) lowest scores are kept and step = sum n_i v_i / sum n_i over the kept (FedAvg of them).

Every update a rule does not take whole is in ``Aggregate.screened`` (index, action, reason, weight);
``round_writer`` names its node in state.json's ``screened``. None of them declares central DP, so each is
refused under ``[privacy] mode = "central"`` (``update_rules.privacy_problem``): docs/howto/robust.md says why.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedmvp_formats.privacy import PrivacyRecord

from fedmvp.federated.aggregate import Aggregate, Update, staleness_weight

Deltas = list[dict[str, np.ndarray]]


def _discounted(theta: Mapping[str, np.ndarray], updates: Sequence[Update], exponent: float
                ) -> tuple[Deltas, list[float]]:
    """v_i = s(t_i) (x_i - base_i) in float64, and s(t_i)."""
    s = [staleness_weight(u.staleness, exponent) for u in updates]
    vs = [{k: w * (np.asarray(x, np.float64) - np.asarray((u.base if u.base is not None else theta)[k], np.float64))
           for k, x in u.arrays.items()} for u, w in zip(updates, s)]
    return vs, s


def _norm(v: Mapping[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum(x * x)) for x in v.values()))


def _mean(vs: Deltas, examples: Sequence[float]) -> dict[str, np.ndarray]:
    """sum n_i v_i / sum n_i per tensor, over the updates that sent it."""
    sums: dict[str, np.ndarray] = {}
    totals: dict[str, float] = {}
    for v, n in zip(vs, examples):
        for key, value in v.items():
            sums[key] = sums[key] + n * value if key in sums else n * value
            totals[key] = totals.get(key, 0.0) + n
    return {k: sums[k] / totals[k] for k in sums}


def _shares(updates: Sequence[Update], kept: Sequence[bool]) -> list[float]:
    """n_i / sum n over the kept updates that sent its first tensor (0 for an update not kept)."""
    totals: dict[str, float] = {}
    for u, keep in zip(updates, kept):
        for key in u.arrays:
            totals[key] = totals.get(key, 0.0) + (u.examples if keep else 0.0)
    return [u.examples / totals[min(u.arrays)] if keep else 0.0 for u, keep in zip(updates, kept)]


def _result(theta: Mapping[str, np.ndarray], updates: Sequence[Update], s: list[float], step: dict[str, np.ndarray],
            server_lr: float, weights: Sequence[float]) -> Aggregate:
    """theta + eta step (float32) and per update staleness, s(t), weight (the share of its delta that reached
    theta)."""
    tensors = {k: (np.asarray(theta[k], np.float64) + server_lr * v).astype(np.float32) for k, v in step.items()}
    return Aggregate(tensors, [{"staleness": u.staleness, "s": w, "weight": server_lr * w * share}
                               for u, w, share in zip(updates, s, weights)], clipped=[None] * len(updates))


def _screen(out: Aggregate, index: int, action: str, reason: str) -> None:
    out.screened.append({"update": index, "action": action, "reason": reason,
                         "weight": out.weights[index]["weight"]})


# ---- the rules -------------------------------------------------------------------------------------------
def norm_clip(theta: Mapping[str, np.ndarray], updates: Sequence[Update], *, server_lr: float = 1.0,
              exponent: float = 0.5, privacy: PrivacyRecord | None = None, server: Any = None) -> Aggregate:
    """FedAvg of the discounted deltas, each clipped to robust_clip_factor x their median norm."""
    factor = server.robust_clip_factor
    vs, s = _discounted(theta, updates, exponent)
    norms = [_norm(v) for v in vs]
    median = float(np.median(norms))
    bound = factor * median
    scale = [bound / n if n > bound else 1.0 for n in norms]
    step = _mean([{k: x * c for k, x in v.items()} for v, c in zip(vs, scale)], [u.examples for u in updates])
    # the weight of a delta d_i: eta n_i s_i c_i / sum n (s_i is applied by ``_result``)
    out = _result(theta, updates, s, step, server_lr,
                  [share * c for share, c in zip(_shares(updates, [True] * len(updates)), scale)])
    for i, (n, c) in enumerate(zip(norms, scale)):
        if c < 1.0:
            out.clipped[i] = n
            _screen(out, i, "clipped", f"delta norm {n:.3g} > bound {bound:.3g} ({factor:g} x the median "
                                       f"{median:.3g}), scaled by {c:.3g}")
    return out


def trim_count(fraction: float, m: int) -> int:
    """k of ``trimmed_mean``: floor(fraction m), at least 1 when fraction > 0 and m >= 3, at most (m - 1) // 2."""
    k = math.floor(fraction * m)
    if fraction > 0 and m >= 3:
        k = max(k, 1)
    return max(0, min(k, (m - 1) // 2))


def _coordinatewise(theta: Mapping[str, np.ndarray], updates: Sequence[Update], server_lr: float, exponent: float,
                    coefficients) -> tuple[Aggregate, list[float]]:
    """A per-coordinate order statistic: ``coefficients(m)`` gives the weight of each rank (ascending) among
    the m updates that sent a tensor; step = sum over ranks of weight x value. Returns the Aggregate and per
    update the share of its coordinates that got no weight."""
    vs, s = _discounted(theta, updates, exponent)
    step: dict[str, np.ndarray] = {}
    used = [0.0] * len(updates)  # sum over its coordinates of its coefficient
    sent = [0] * len(updates)
    unused = [0] * len(updates)
    for key in sorted({k for v in vs for k in v}):
        senders = [i for i, v in enumerate(vs) if key in v]
        stack = np.stack([vs[i][key].reshape(-1) for i in senders])  # (m, coordinates)
        ranks = np.argsort(stack, axis=0, kind="stable")
        coef = np.asarray(coefficients(len(senders)), np.float64)  # (m,) weight per rank
        ordered = np.take_along_axis(stack, ranks, axis=0)
        step[key] = (coef[:, None] * ordered).sum(axis=0).reshape(vs[senders[0]][key].shape)
        per_sender = np.zeros_like(stack)
        np.put_along_axis(per_sender, ranks, np.broadcast_to(coef[:, None], stack.shape), axis=0)
        for row, i in enumerate(senders):
            used[i] += float(per_sender[row].sum())
            sent[i] += stack.shape[1]
            unused[i] += int(np.count_nonzero(per_sender[row] == 0))
    out = _result(theta, updates, s, step, server_lr, [u / c for u, c in zip(used, sent)])
    return out, [z / c for z, c in zip(unused, sent)]


def trimmed_mean(theta: Mapping[str, np.ndarray], updates: Sequence[Update], *, server_lr: float = 1.0,
                 exponent: float = 0.5, privacy: PrivacyRecord | None = None, server: Any = None) -> Aggregate:
    """Per coordinate, the mean of the discounted deltas left after dropping k at each end."""
    fraction = server.trim_fraction

    def coefficients(m: int) -> list[float]:
        k = trim_count(fraction, m)
        return [0.0] * k + [1.0 / (m - 2 * k)] * (m - 2 * k) + [0.0] * k

    out, dropped = _coordinatewise(theta, updates, server_lr, exponent, coefficients)
    for i, share in enumerate(dropped):
        if share > 0:
            _screen(out, i, "down-weighted", f"{share:.0%} of its coordinates trimmed (trim_fraction "
                                             f"{fraction:g}, {trim_count(fraction, len(updates))} of "
                                             f"{len(updates)} at each end)")
    return out


def median(theta: Mapping[str, np.ndarray], updates: Sequence[Update], *, server_lr: float = 1.0,
           exponent: float = 0.5, privacy: PrivacyRecord | None = None, server: Any = None) -> Aggregate:
    """Per coordinate, the median of the discounted deltas (the mean of the two middle ones for even m)."""

    def coefficients(m: int) -> list[float]:
        c = [0.0] * m
        if m % 2:
            c[m // 2] = 1.0
        else:
            c[m // 2 - 1] = c[m // 2] = 0.5
        return c

    out, unused = _coordinatewise(theta, updates, server_lr, exponent, coefficients)
    for i, share in enumerate(unused):
        if share > 0:
            _screen(out, i, "down-weighted", f"{1 - share:.0%} of its coordinates at the median")
    return out


def krum_scores(vs: Deltas, f: int) -> list[float]:
    """Per v_i: the sum of squared distances to its max(n - f - 2, 1) nearest others (Blanchard et al. 2017)."""
    n = len(vs)
    if n == 1:
        return [0.0]
    keys = sorted({k for v in vs for k in v})
    flat = np.stack([np.concatenate([v[k].reshape(-1) if k in v else np.zeros(_size(vs, k)) for k in keys])
                     for v in vs])
    squared = np.sum(flat * flat, axis=1)
    distances = np.maximum(squared[:, None] + squared[None, :] - 2.0 * flat @ flat.T, 0.0)
    near = min(max(n - f - 2, 1), n - 1)
    return [float(np.sort(np.delete(distances[i], i))[:near].sum()) for i in range(n)]


def _size(vs: Deltas, key: str) -> int:
    return next(v[key].size for v in vs if key in v)


def multi_krum(theta: Mapping[str, np.ndarray], updates: Sequence[Update], *, server_lr: float = 1.0,
               exponent: float = 0.5, privacy: PrivacyRecord | None = None, server: Any = None) -> Aggregate:
    """FedAvg of the discounted deltas of the max(n - f, 1) updates with the lowest Krum scores."""
    f = server.assumed_malicious
    vs, s = _discounted(theta, updates, exponent)
    scores = krum_scores(vs, f)
    keep = max(len(updates) - f, 1)
    order = sorted(range(len(updates)), key=lambda i: (scores[i], i))  # ties: the earlier update (a fixed order)
    kept = [False] * len(updates)
    for i in order[:keep]:
        kept[i] = True
    step = _mean([v for v, k in zip(vs, kept) if k], [u.examples for u, k in zip(updates, kept) if k])
    out = _result(theta, updates, s, step, server_lr, _shares(updates, kept))
    middle = float(np.median(scores))
    for i in range(len(updates)):
        if not kept[i]:
            ratio = f"{scores[i] / middle:.3g}x the median" if middle > 0 else "the median is 0"
            _screen(out, i, "dropped", f"Krum score {scores[i]:.2e}, {ratio}; assumed_malicious {f}")
    return out


ROBUST_RULES = {"norm_clip": norm_clip, "trimmed_mean": trimmed_mean, "median": median, "multi_krum": multi_krum}
