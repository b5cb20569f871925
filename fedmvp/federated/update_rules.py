"""The server's update rules by name: ``[server] update_rule`` selects one (docs/architecture.md, "How to
add ..."). A rule turns a round's checked updates into the new values of the tensors they sent; every
round of a run, synchronous, buffered or ingested, goes through the one rule its record names
(``round_writer.RoundWriter``), which is what makes the rule swappable in one place.

A rule is called as ``rule(theta, updates, *, server_lr, exponent, privacy)`` and returns an
``aggregate.Aggregate`` (the new tensors, per update what it weighed, the central-DP step's record, and
``screened``: the updates it did not take whole). A rule that declares a keyword ``server`` also gets the
run's ``ServerSpec`` (its own keys: the robust rules' trim_fraction, robust_clip_factor,
assumed_malicious; ``robust_rules.py``, docs/howto/robust.md).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from fedmvp.federated.aggregate import Aggregate, apply_updates
from fedmvp.federated.robust_rules import ROBUST_RULES

UpdateRule = Callable[..., Aggregate]  # (theta, updates, *, server_lr, exponent, privacy[, server]) -> Aggregate

DEFAULT_RULE = "fedavg"  # staleness-weighted FedAvg of the deltas (docs/method.md §6)

UPDATE_RULES: dict[str, UpdateRule] = {
    DEFAULT_RULE: apply_updates,
    **ROBUST_RULES,  # norm_clip, trimmed_mean, median, multi_krum
}


def register_update_rule(name: str, rule: UpdateRule) -> None:
    """Make ``rule`` selectable as ``[server] update_rule = "name"`` (a name already taken is refused)."""
    if name in UPDATE_RULES and UPDATE_RULES[name] is not rule:
        raise ValueError(f"update rule {name!r} is already registered")
    UPDATE_RULES[name] = rule


def update_rule(name: str) -> UpdateRule:
    """The rule registered as ``name``; an unknown name is one line listing the known ones."""
    try:
        return UPDATE_RULES[name]
    except KeyError:
        raise ValueError(f"[server] update_rule {name!r} is not a known update rule (known: "
                         f"{', '.join(sorted(UPDATE_RULES))})") from None


def takes_server(rule: UpdateRule) -> bool:
    """The rule declares a ``server`` keyword: it is passed the run's ServerSpec."""
    try:
        return "server" in inspect.signature(rule).parameters
    except (TypeError, ValueError):  # a callable without a signature: the base call only
        return False
