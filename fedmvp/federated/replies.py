"""Every client reply is checked before it is averaged.

A reply that arrives over the network is untrusted: a crashed client, a client of another run,
a stale reply of an earlier round, a NaN, a wrong shape or an oversized update must never reach
the global model. ``check_reply`` applies the rules in order and either returns the tensors to
average (possibly clipped) or the reason the reply was left out. The server logs every
rejection (node, site, reason) and records it in the round's state.json; the round goes on
with the other replies. Its tensor checks (``tensor_problem``) and the update-norm bound
(``bound_update``) also judge the update files of `fedmvp ingest` (``ingest.py``).

Two kinds of sender: a **site** (identified by the ``partition-id`` it serves; it sends the
tensors of its mode, at most its training set's images) and an **edge** device (``role``
``edge``, ``edge-client join``; LoRA only, as a site in LoRA-only mode, at most
``[server] edge_max_examples`` images). The same rules hold for both.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

NORM_ACTIONS = ("reject", "clip")
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,120}")


def shown(value: Any, limit: int = 60) -> str:
    """``value`` as a one-line reason may show it: ``repr`` (newlines, ANSI escapes and every other
    unprintable character escaped), at most ``limit`` characters. What a sender wrote never reaches
    a terminal, a log or state.json raw, nor megabytes of it."""
    if isinstance(value, (str, bytes)):
        text = repr(value[:limit])
        return text if len(value) <= limit and len(text) <= limit + 3 else text[:limit] + "..."
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return "a huge integer"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    return f"a {type(value).__name__}"


def name_shown(name: str) -> str:
    """A tensor or record key as a reason shows it: as is when it looks like a name, else `shown`."""
    return name if _PLAIN_NAME.fullmatch(name) else shown(name)


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
    problem = tensor_problem(arrays, global_state, wanted)
    if problem is not None:
        return Verdict(site, role=role, reason=problem)
    as_float32 = {k: np.asarray(arrays[k], dtype=np.float32) for k in sorted(arrays)}
    kept, reason, clipped_from = bound_update(as_float32, global_state, rules.max_update_norm, rules.norm_action)
    return Verdict(site, arrays=kept, reason=reason, clipped_from=clipped_from, role=role)


def tensor_problem(arrays: dict[str, np.ndarray], reference: dict[str, np.ndarray], wanted: set[str],
                   dtype: np.dtype | None = None) -> str | None:
    """Why ``arrays`` cannot be averaged into ``reference``, or None: names exactly ``wanted``, the
    reference's shapes, floating point (exactly ``dtype`` when given), all finite. Shared by the
    server's replies and `fedmvp ingest`'s update files."""
    names = set(arrays)
    if names != wanted:
        missing, extra = sorted(wanted - names), sorted(names - wanted)
        parts = ([f"missing {_listed(missing)}"] if missing else []) + \
                ([f"unexpected {_listed(extra)}"] if extra else [])
        return f"tensor names do not match the round ({'; '.join(parts)})"
    for name in sorted(names):
        value, ref = arrays[name], reference.get(name)
        if ref is None or tuple(value.shape) != tuple(ref.shape):
            want = None if ref is None else list(ref.shape)
            return f"{name}: shape {list(value.shape)}, the round's is {want}"
        if not np.issubdtype(value.dtype, np.floating) or (dtype is not None and value.dtype != dtype):
            return f"{name}: dtype {value.dtype} is not {'floating point' if dtype is None else np.dtype(dtype)}"
        if not np.all(np.isfinite(value)):
            return f"{name}: holds NaN or infinite values"
    return None


def _listed(names: list[str], first: int = 3) -> str:
    """The first names (escaped) and how many more: a reason stays one bounded line."""
    more = f" and {len(names) - first} more" if len(names) > first else ""
    return ", ".join(name_shown(n) for n in names[:first]) + more


def bound_update(arrays: dict[str, np.ndarray], reference: dict[str, np.ndarray], max_norm: float | None,
                 action: str) -> tuple[dict[str, np.ndarray] | None, str | None, float | None]:
    """The L2 bound on an update's distance to ``reference``: ``(arrays, None, None)`` within it,
    ``(clipped, None, norm)`` clipped onto it, ``(None, reason, None)`` rejected (``action``)."""
    if max_norm is None:
        return arrays, None, None
    deltas = {k: arrays[k].astype(np.float64) - reference[k].astype(np.float64) for k in arrays}
    norm = math.sqrt(sum(float(np.sum(d * d)) for d in deltas.values()))
    if norm <= max_norm:
        return arrays, None, None
    if action == "reject":
        return None, f"update norm {norm:.4g} exceeds the bound {max_norm:g}", None
    scale = max_norm / norm
    clipped = {k: (reference[k].astype(np.float64) + deltas[k] * scale).astype(np.float32) for k in arrays}
    return clipped, None, norm
