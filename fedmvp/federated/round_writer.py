"""One round's lifecycle, the same for synchronous rounds, buffered versions and `fedmvp ingest`.

Whatever produced the updates (a Flower round's checked replies, a buffer of device deltas, update
files), a round is written the same way: the updates are checked (every tensor finite and shaped as
the tensor it updates), the round is charged to the privacy budget (``privacy_budget.charge``; past
``max_epsilon`` nothing is written), the run's update rule (``update_rules``: [server] update_rule, or
``device_rule`` where every update comes from an edge device) is applied (under central DP it must return
its noise record), the result must be finite, the round is summarised into one `RoundRecord` (its ``to_json`` is
the round's state.json; a rule other than fedavg adds ``screened``: the updates it did not take whole, with one
log line per round) and saved whole (``RunDir.save_checkpoint``, atomic), then its metrics row is
appended and the progress shown. docs/method.md §6 (the rule), docs/howto/privacy.md (the charge).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from logging import INFO
from typing import Any

import numpy as np
from flwr.supercore import log

from fedmvp_formats.names import LORA_PREFIX
from fedmvp_formats.privacy import CENTRAL, PrivacyRecord

from fedmvp.federated.aggregate import Aggregate, Update
from fedmvp.federated.privacy_budget import BudgetExceeded, Event, charge
from fedmvp.federated.private_rounds import Draw, release
from fedmvp.federated.count_cap import cap_counts
from fedmvp.federated.update_rules import (DEFAULT_RULE, privacy_problem, rule_name, takes_server,
                                           unknown_rule_problem, update_rule)
from fedmvp.presets.server import ServerSpec


class RoundFailed(RuntimeError):
    """A round could not gather enough usable replies (or nodes), or would not be finite or within the
    privacy budget; the message says why."""


@dataclass
class RoundRecord:
    """What one written round is: its metrics row (metrics.csv, and state.json ``metrics``) and what
    state.json keeps of how it came about. ``to_json`` is the round's state.json content (``round`` and
    ``complete`` are added by ``RunDir.save_checkpoint``)."""

    round: int
    metrics: dict[str, Any]  # the metrics row; evaluation results are added to it when the round is due
    lora_clients: list[int] = field(default_factory=list)  # sites that train the LoRA from the next round
    seed: int | None = None  # the run's seed (its sampling replays from it)
    lr: float | None = None  # the base learning rate of the cosine schedule
    total_rounds: int | None = None
    method: dict[str, Any] | None = None  # the run's method record
    sites: list[int] = field(default_factory=list)  # sites whose update is in the round
    replies: list[dict] = field(default_factory=list)  # per accepted update: node, role, examples, weight, ...
    rejected: list[dict] = field(default_factory=list)  # per left-out reply: node, site, reason
    privacy: dict[str, Any] | None = None  # [privacy]: the round's charge (None: nothing charged)
    not_private: str | None = None  # why the round is not differentially private (None: it is, or no [privacy])
    timed_out: list[str] = field(default_factory=list)  # who was sent the round's work and never replied
    seconds: float = 0.0  # wall-clock seconds the round took (training, checks and the update rule)
    late: list[str] = field(default_factory=list)  # over-selected devices discarded as late (``dropouts``)
    devices: dict[str, Any] | None = None  # edge devices selected, wanted, replied, late, timed out (None: ingest)
    carried: dict[str, Any] | None = None  # an ingested round: its base round's state.json, keys in place
    ingest: dict[str, Any] | None = None  # an ingested round: source, ingested_onto, ingest_rules, ingest
    screened: list[dict] | None = None  # a rule other than fedavg: per update not taken whole, node, role, action,
    # reason, weight (docs/howto/robust.md); None: the key is not written (fedavg's record is unchanged)

    def to_json(self) -> dict[str, Any]:
        if self.carried is not None:  # `fedmvp ingest`: the base round's record with this round's parts
            out = _ingest_order(self.carried, self.ingest or {}, self.metrics)
        else:
            out = {"lora_clients": list(self.lora_clients), "seed": self.seed, "lr": self.lr,
                   "total_rounds": self.total_rounds, "method": self.method, "sites": list(self.sites),
                   "replies": list(self.replies), "rejected": list(self.rejected), "metrics": self.metrics}
        if self.privacy is not None:
            out["privacy"] = self.privacy
        if self.not_private is not None:
            out["not_private"] = self.not_private
        if self.screened is not None:
            out["screened"] = list(self.screened)
        return {**out, "timed_out": list(self.timed_out), "seconds": self.seconds,
                **({"late": list(self.late), "devices": dict(self.devices)} if self.devices is not None else {})}


def _ingest_order(carried: dict[str, Any], ingest: dict[str, Any], metrics: dict[str, Any]) -> dict[str, Any]:
    """The base round's keys where they were, then ``source``, ``ingested_onto``, ``metrics``, the rules and
    the files (a key the base had keeps its place)."""
    out = dict(carried)
    out |= {"source": ingest.get("source"), "ingested_onto": ingest.get("ingested_onto"), "metrics": metrics,
            **{k: v for k, v in ingest.items() if k not in ("source", "ingested_onto")}}
    return out


class Progress:
    """The rounds' progress bar (``fedmvp train``): a round per save, its loss and LoRA clients, and the
    not-private line the bar would hide."""

    def __init__(self, start: int, total: int):
        from tqdm import tqdm

        self.total = total
        self.bar = tqdm(total=total, initial=start, desc="rounds", unit="round")

    def __call__(self, record: RoundRecord) -> None:
        if record.not_private is not None:  # the log line the progress bar hides (docs/howto/privacy.md)
            self.bar.write(f"round {record.round}: {record.not_private}")
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{record.metrics['train_loss']:.3f}", lora=record.metrics["lora_clients"])
        if record.round == self.total:
            self.bar.close()


class RoundWriter:
    """The lifecycle of every round of a run: ``charge``, ``apply`` (check, the update rule, finite),
    ``released`` (the privacy part of the record) and ``save`` (state.json, weights, metrics row, progress).

    ``run`` None: rounds are computed but not saved (a strategy driven by tests); ``events``: the run's
    recorded privacy events, appended as rounds are released; ``fail``: the error a failed check raises
    (online: `RoundFailed`; `fedmvp ingest`: its own one-line RunError)."""

    def __init__(self, run=None, server: ServerSpec | None = None, privacy: PrivacyRecord | None = None,
                 events: Sequence[Event] = (), *, fail: Callable[[str], Exception] = RoundFailed,
                 progress: Callable[[RoundRecord], None] | None = None):
        self.run, self.server, self.privacy = run, server or ServerSpec(), privacy
        self.events: list[Event] = list(events)
        self.fail, self.progress = fail, progress
        problem = unknown_rule_problem(self.server)  # a rule this fedmvp does not know (a newer run's, a typo)
        problem = problem or privacy_problem(self.server, privacy)  # a run record edited after the preset check
        if problem is not None:
            raise fail(problem)
        self.applied = self.server.update_rule  # the rule the last ``apply`` used (``rule_name``)
        self.count_cap: dict[str, Any] | None = None  # the last ``apply``'s cap on example counts (count_cap.py)

    def charge(self, rate: float, round_number: int) -> dict[str, Any] | None:
        """The round's privacy record at sampling rate ``rate`` (None: no [privacy]); past max_epsilon the
        round is refused (``fail``) before anything is written."""
        if self.privacy is None:
            return None
        try:
            return charge(self.privacy, self.events, rate, round_number)
        except BudgetExceeded as err:
            raise self.fail(str(err)) from None

    def apply(self, label: str, theta: Mapping[str, np.ndarray], updates: Sequence[Update],
              senders: Sequence[tuple[Any, str]] = ()) -> Aggregate:
        """The update rule over checked ``updates`` applied to ``theta``; ``label`` ("round 3") names the
        round in a failure and its screening line. ``senders``: per update its node (an update file: its
        name) and role, which name the rule's ``screened`` entries. A non-finite result is never published."""
        for i, update in enumerate(updates):
            base = update.base if update.base is not None else theta
            for key, value in update.arrays.items():
                if key not in base or np.shape(value) != np.shape(base[key]):
                    raise self.fail(f"{label}: update {i} sends {key} with shape {np.shape(value)}, which the "
                                    f"state it updates does not hold")
                if not np.all(np.isfinite(value)):
                    raise self.fail(f"{label}: update {i} holds NaN or infinite values in {key}")
        problem = privacy_problem(self.server, self.privacy)  # privacy set after construction
        if problem is not None:
            raise self.fail(problem)
        name = rule_name(self.server, self.privacy, [role for _, role in senders])
        rule = update_rule(name)
        self.applied = name
        updates, self.count_cap = cap_counts(updates, self.server.count_cap, senders)  # recorded by ``save``
        step = rule(theta, updates, server_lr=self.server.server_lr, exponent=self.server.staleness_exponent,
                    privacy=self.privacy, **({"server": self.server} if takes_server(rule) else {}))
        bad = next((k for k, v in step.tensors.items() if not np.all(np.isfinite(v))), None)
        if bad is not None:  # never publish (or train on) a NaN global state
            raise self.fail(f"{label}: the averaged tensor {bad} holds NaN or infinite values; the run stops")
        if self.privacy is not None and self.privacy.mode == CENTRAL and step.privacy is None and any(
                k.startswith(LORA_PREFIX) for u in updates for k in u.arrays):
            raise self.fail(f"{label}: update rule {name} returned no central-DP noise record for the LoRA "
                            f"([privacy] mode = 'central'); nothing is written (docs/howto/robust.md)")
        if name != DEFAULT_RULE:
            step.screened = [_named(entry, senders) for entry in step.screened]
            log(INFO, "%s", screening_line(label, name, step.screened, len(updates)))
        return step

    def screened(self, step: Aggregate) -> list[dict] | None:
        """The round record's ``screened`` (None under fedavg: its record keeps its keys)."""
        return None if self.applied == DEFAULT_RULE else list(step.screened)

    def released(self, charged: dict[str, Any] | None, step: Aggregate, round_number: int, draw: Draw | None,
                 contents: Sequence[tuple[int | None, str, int | None, Collection[str]]] = ()) -> dict[str, Any]:
        """The record's privacy part (``privacy``, ``not_private``): an online release's (``draw``: how its
        devices came; ``contents``: per update node, role, site, tensor names; ``private_rounds.release``)
        or an ingest's (``draw`` None: the charge and the noise step)."""
        if charged is None:
            return {}
        if draw is None:
            return {"privacy": {**charged, **(step.privacy or {})}}
        return release(charged, step.privacy, draw, self.events, round_number, contents)

    def save(self, record: RoundRecord, state: Mapping[str, Any], *, replace: bool = True) -> None:
        """Publish the round whole (``state``: every global tensor), then its metrics row and progress."""
        if self.run is None:
            return
        from fedmvp.federated.wire import to_torch_state
        from fedmvp.run_metrics import append_metrics, plot

        tensors = {k: to_torch_state({k: v})[k] if isinstance(v, np.ndarray) else v for k, v in state.items()}
        recorded = record.to_json()
        if self.count_cap is not None and self.count_cap["capped"]:  # the cap, where it changed a weight
            recorded["count_cap"] = self.count_cap
        self.run.save_checkpoint(record.round, tensors, recorded, replace=replace)
        append_metrics(self.run, record.metrics)
        if "hm" in record.metrics:
            plot(self.run)
        if self.progress is not None:
            self.progress(record)


def _named(entry: dict[str, Any], senders: Sequence[tuple[Any, str]]) -> dict[str, Any]:
    """A rule's screened entry (``update``: an index) as state.json keeps it: node, role, action, reason, weight."""
    if "update" not in entry:
        return entry
    node, role = senders[entry["update"]] if entry["update"] < len(senders) else (entry["update"], None)
    return {"node": node, "role": role, "action": entry["action"], "reason": entry["reason"],
            "weight": entry["weight"]}


def screening_line(label: str, rule: str, screened: Sequence[dict[str, Any]], count: int) -> str:
    """The round's one line: the update the rule weighed least, and how many more it screened."""
    if not screened:
        return f"{label}: update rule {rule} took all {count} updates whole"
    worst = min(screened, key=lambda e: (e["weight"], str(e["node"])))
    node = str(worst["node"]) if str(worst["node"]).isprintable() else repr(worst["node"])  # a file's name: one line
    more = f"; {len(screened) - 1} more screened (state.json 'screened')" if len(screened) > 1 else ""
    return f"{label}: update rule {rule} {worst['action']} node {node} ({worst['reason']}){more}"


def finite_loss(label: str, loss: float) -> None:
    """A synchronous round whose training loss is not finite stops the run (its replies were finite)."""
    if not math.isfinite(loss):
        raise RoundFailed(f"{label}: the training loss is {loss}; the run stops "
                          f"(check the preset's lr and the last checkpoint)")
