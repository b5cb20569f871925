"""Every client reply is checked before it is averaged.

A reply that arrives over the network is untrusted: a crashed client, a client of another run,
a stale reply of an earlier round, a NaN, a wrong shape or an oversized update must never reach
the global model. ``check_reply`` applies the rules in order and either returns the tensors to
average (possibly clipped) or the reason the reply was left out. The server logs every
rejection (node, site, reason) and records it in the round's state.json; the round goes on
with the other replies.

Two kinds of sender: a **site** (identified by the ``partition-id`` it serves; it sends the
tensors of its mode, at most its training set's images) and an **edge** device (``role``
``edge``, ``edge-client join``; LoRA only, as a site in LoRA-only mode, at most
``[server] edge_max_examples`` images). The same rules hold for both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

NORM_ACTIONS = ("reject", "clip")


@dataclass(frozen=True)
class ReplyRules:
    """What a reply must satisfy. ``max_update_norm``: the largest L2 distance of a reply's tensors to
    the round's global tensors (None: no bound); beyond it the reply is clipped back onto the
    bound or rejected (``norm_action``)."""

    run_id: str
    round: int
    max_update_norm: float | None = None
    norm_action: str = "reject"
    edge_max_examples: int = 10000


@dataclass
class Verdict:
    """The outcome for one reply: ``arrays`` to average, or ``reason`` it was left out."""

    site: int | None
    arrays: dict[str, np.ndarray] | None = None
    role: str = "site"  # or "edge"
    reason: str | None = None
    clipped_from: float | None = None  # the update norm before clipping, when it was clipped
    notes: list[str] = field(default_factory=list)

    @property
    def accepted(self) -> bool:
        return self.arrays is not None


def _int(metrics: Any, key: str) -> int | None:
    try:
        value = metrics[key]
    except KeyError:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        return None
    return int(value) if float(value) == int(value) else None


def check_reply(arrays: dict[str, np.ndarray], metrics: Any, *, rules: ReplyRules,
                global_state: dict[str, np.ndarray], expected_names: dict[int, set[str]],
                declared_examples: dict[int, int]) -> Verdict:
    """Check one train reply. ``expected_names[site]``: the tensors that site was asked to send
    (LoRA only after its switch, else the PromptFormer); ``declared_examples[site]``: the most
    training images that site can hold (from the run record). An edge device (``role`` ``edge``)
    must send exactly the round's LoRA tensors and at most ``rules.edge_max_examples`` images."""
    edge = metrics.get("role") == "edge"
    site = None if edge else _int(metrics, "partition-id")
    role = "edge" if edge else "site"
    if not edge and (site is None or site not in expected_names):
        return Verdict(site, reason=f"unknown site {metrics.get('partition-id')!r}")
    if metrics.get("run-id") != rules.run_id:
        return Verdict(site, role=role, reason=f"reply of another run ({metrics.get('run-id')!r})")
    if _int(metrics, "round") != rules.round:
        return Verdict(site, role=role, reason=f"reply of round {metrics.get('round')!r}, not of round {rules.round}")
    examples = _int(metrics, "num-examples")
    if examples is None or examples <= 0:
        return Verdict(site, role=role,
                       reason=f"num-examples {metrics.get('num-examples')!r} is not a positive integer")
    bound = rules.edge_max_examples if edge else declared_examples.get(site, 0)
    if examples > bound:
        whose = f"an edge device's bound ([server] edge_max_examples {bound})" if edge \
            else f"the site's {bound} training images"
        return Verdict(site, role=role, reason=f"num-examples {examples} exceeds {whose}")
    wanted = {k for k in global_state if k.startswith("lora.")} if edge else expected_names[site]
    verdict = check_tensors(arrays, wanted, global_state, rules)
    verdict.site, verdict.role = site, role
    return verdict


def check_tensors(arrays: dict[str, np.ndarray], wanted: set[str], global_state: dict[str, np.ndarray],
                  rules: ReplyRules) -> Verdict:
    """The tensor rules alone: exactly ``wanted`` names, the round's shapes, floating point, finite,
    and within ``max_update_norm`` of the global tensors (rejected or clipped)."""
    names = set(arrays)
    if names != wanted:
        missing, extra = sorted(wanted - names), sorted(names - wanted)
        parts = ([f"missing {', '.join(missing[:3])}"] if missing else []) + \
                ([f"unexpected {', '.join(extra[:3])}"] if extra else [])
        return Verdict(None, reason=f"tensor names do not match the round ({'; '.join(parts)})")
    for name in sorted(names):
        value, reference = arrays[name], global_state.get(name)
        if reference is None or tuple(value.shape) != tuple(reference.shape):
            want = None if reference is None else list(reference.shape)
            return Verdict(None, reason=f"{name}: shape {list(value.shape)}, the round's is {want}")
        if not np.issubdtype(value.dtype, np.floating):
            return Verdict(None, reason=f"{name}: dtype {value.dtype} is not floating point")
        if not np.all(np.isfinite(value)):
            return Verdict(None, reason=f"{name}: holds NaN or infinite values")
    out = {k: np.asarray(arrays[k], dtype=np.float32) for k in sorted(names)}
    if rules.max_update_norm is None:
        return Verdict(None, arrays=out)
    deltas = {k: out[k].astype(np.float64) - global_state[k].astype(np.float64) for k in out}
    norm = math.sqrt(sum(float(np.sum(d * d)) for d in deltas.values()))
    if norm <= rules.max_update_norm:
        return Verdict(None, arrays=out)
    if rules.norm_action == "reject":
        return Verdict(None, reason=f"update norm {norm:.4g} exceeds the bound {rules.max_update_norm:g}")
    scale = rules.max_update_norm / norm
    clipped = {k: (global_state[k].astype(np.float64) + deltas[k] * scale).astype(np.float32) for k in out}
    return Verdict(None, arrays=clipped, clipped_from=norm)
