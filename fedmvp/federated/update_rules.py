"""The server's update rules by name: ``[server] update_rule`` and ``device_rule`` select one (docs/architecture.md,
"How to add ..."). A rule turns a round's checked updates into the new values of the tensors they sent; every
round of a run, synchronous, buffered or ingested, goes through the one rule its record names for its senders
(``rule_name``; ``round_writer.RoundWriter``), which is what makes the rule swappable in one place.

A rule is called as ``rule(theta, updates, *, server_lr, exponent, privacy)`` and returns an
``aggregate.Aggregate`` (the new tensors, per update what it weighed, the central-DP step's record, and
``screened``: the updates it did not take whole). A rule that declares a keyword ``server`` also gets the
run's ``ServerSpec`` (its own keys: the robust rules' trim_fraction, robust_clip_factor,
assumed_malicious; ``robust_rules.py``, docs/howto/robust.md).

A rule says itself whether it implements central differential privacy (clip each LoRA delta to
``clip_norm``, average with equal weights, add the Gaussian noise and return its record in
``Aggregate.privacy``): ``implements_central_dp = True`` on the function (`declares_central_dp`). Under
``[privacy] mode = "central"`` only such a rule is accepted (`privacy_problem`), and the round writer
still refuses a central round whose result carries no noise record (docs/howto/robust.md).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection

from fedmvp_formats.privacy import CENTRAL, PrivacyRecord

from fedmvp.federated.aggregate import Aggregate, apply_updates
from fedmvp.federated.robust_rules import ROBUST_RULES

UpdateRule = Callable[..., Aggregate]  # (theta, updates, *, server_lr, exponent, privacy[, server]) -> Aggregate

DEFAULT_RULE = "fedavg"  # staleness-weighted FedAvg of the deltas (docs/method.md §6)
DEFAULT_DEVICE_RULE = "norm_clip"  # device rounds' default: the poison benchmark's cheapest rule that stopped
# every attack measured (docs/howto/robust.md, "Devices: a robust default")
CENTRAL_DP = "implements_central_dp"  # the attribute a rule sets to declare central DP
EDGE_ROLE = "edge"

UPDATE_RULES: dict[str, UpdateRule] = {
    DEFAULT_RULE: apply_updates,
    **ROBUST_RULES,  # norm_clip, trimmed_mean, median, multi_krum
}


def register_update_rule(name: str, rule: UpdateRule) -> None:
    """Make ``rule`` selectable as ``[server] update_rule = "name"`` (a name already taken is refused). Set
    ``rule.implements_central_dp = True`` first where it implements central DP (`declares_central_dp`)."""
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


def unknown_rule_problem(server) -> str | None:
    """The line naming ``update_rule`` or ``device_rule`` when it is no registered rule (None: both are)."""
    for key, name in (("update_rule", server.update_rule), ("device_rule", server.device_rule)):
        if name is not None and name not in UPDATE_RULES:
            return (f"[server] {key} {name!r} is not a known update rule (known: "
                    f"{', '.join(sorted(UPDATE_RULES))})")
    return None


def declares_central_dp(name: str) -> bool:
    """The rule registered as ``name`` says it implements central DP (an unknown name: no)."""
    return getattr(UPDATE_RULES.get(name), CENTRAL_DP, False) is True


def device_rule_name(server, privacy: PrivacyRecord | None) -> str:
    """The rule of a round whose updates all come from edge devices: ``[server] device_rule`` where set;
    else ``update_rule`` where that names a rule other than fedavg (one key set, every round follows it);
    else the devices' default, ``norm_clip``, or under central DP ``fedavg`` (its fixed ``clip_norm``
    already bounds each update, and no robust rule keeps the noise's calibration)."""
    if server.device_rule is not None:
        return server.device_rule
    if server.update_rule != DEFAULT_RULE:
        return server.update_rule
    return DEFAULT_RULE if privacy is not None and privacy.mode == CENTRAL else DEFAULT_DEVICE_RULE


def rule_name(server, privacy: PrivacyRecord | None, roles: Collection[str]) -> str:
    """The rule a round's updates go through: ``device_rule_name`` when every sender is an edge device
    (`fedmvp ingest`, buffered versions, a served round of devices only), else ``update_rule``."""
    if roles and all(role == EDGE_ROLE for role in roles):
        return device_rule_name(server, privacy)
    return server.update_rule


def privacy_problem(server, privacy: PrivacyRecord | None) -> str | None:
    """The one line refusing a rule that does not declare central DP under ``[privacy] mode = "central"``
    (``update_rule``, and ``device_rule`` where the run's device rounds would use it); None: allowed."""
    if privacy is None or privacy.mode != CENTRAL:
        return None
    for key, name in (("update_rule", server.update_rule), ("device_rule", device_rule_name(server, privacy))):
        if name in UPDATE_RULES and not declares_central_dp(name):
            return (f"[server] {key} = {name!r} with [privacy] mode = 'central' is refused: the central clip "
                    f"and noise are calibrated to FedAvg of clipped deltas (sensitivity clip_norm / m), which a "
                    f"rule that drops, trims or rescales by the other updates breaks, and {name!r} does not "
                    f"declare central DP; use {key} = 'fedavg' (clip_norm bounds each update) or mode = 'local' "
                    f"(docs/howto/robust.md)")
    return None
