"""The server rules: how rounds run across machines and which replies and update files count.

ONE definition of their names, defaults, ranges and help (docs/architecture.md, "Records that
travel"): the preset's ``[server]`` table is parsed into ``ServerSpec``, config.json records it
whole (``server``), and the strategy (``RoundPolicy``), the reply checks (``ReplyRules``) and
`fedmvp ingest` read that record back through ``ServerSpec.from_record``. `fedmvp serve` flags and
`fedmvp ingest --max-staleness` are overrides of this one record, checked by the same ranges.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, fields
from typing import Any

from fedmvp.presets.fields import is_float, spec_field, type_name, type_ok

NORM_ACTIONS = ("reject", "clip")
MODES = ("sync", "buffered")


class ServerRecordError(ValueError):
    """A server record or override out of type or range; the message names where and the key."""


@dataclass(frozen=True)
class ServerSpec:
    """How the server runs rounds across machines and which replies it accepts (docs/architecture.md)."""

    min_nodes: int | None = spec_field("replies a round needs (and nodes that must be connected before it "
                                       "starts); default: the clients sampled per round", None)
    round_timeout: float = spec_field("seconds a round waits for replies; then it closes with what came back "
                                      "if at least min_nodes did, else it is tried again", 3600.0)
    node_wait: float = spec_field("seconds to wait for min_nodes connected nodes before giving up", 600.0)
    round_retries: int = spec_field("tries of a round that got fewer than min_nodes replies", 3)
    max_update_norm: float | None = spec_field("largest L2 distance of a reply's tensors to the round's "
                                               "global tensors (none: no bound)", None)
    update_norm_action: str = spec_field("beyond max_update_norm: 'reject' the reply or 'clip' it onto "
                                         "the bound", "reject")
    edge_max_examples: int = spec_field("most images an edge device's reply or update file may count (its "
                                        "FedAvg weight); a site's bound is its own training set", 10000)
    site_max_examples: int = spec_field("most images a [federation] site's reply may count when the server "
                                        "cannot bound its training set (shots unset: the site's own folder, "
                                        "which the server never sees)", 10000)
    max_staleness: int = spec_field("`fedmvp ingest`: rounds an update's bundle may be behind the run's "
                                    "last round (0: only updates of bundles exported from that round); "
                                    "mode = 'buffered': versions a reply's base may be behind", 5)
    staleness_exponent: float = spec_field("a in s(t) = (1 + t)^(-a): an update t rounds behind the state it is "
                                           "applied to moves it s(t) times what a fresh one would (0: no discount)",
                                           0.5)
    server_lr: float = spec_field("eta: the server applies eta times the weighted mean of the updates' deltas "
                                  "(1: FedAvg when every update is fresh)", 1.0)
    mode: str = spec_field("'sync': rounds with a barrier (sites and devices); 'buffered': edge devices "
                           "train asynchronously and a version is written every buffer_size updates "
                           "(FedBuff; `fedmvp serve` only)", "sync")
    update_rule: str = spec_field("the server's update rule by name (fedmvp/federated/update_rules.py): 'fedavg', "
                                  "the staleness-weighted FedAvg of the updates' deltas", "fedavg")
    concurrency: int = spec_field("mode = 'buffered': edge devices kept training at once", 4)
    buffer_size: int = spec_field("mode = 'buffered': accepted device updates that make the next version", 2)

    def problem(self) -> str | None:
        """The first value out of range, as one message (None: all in range). A preset's [server] table,
        a run's recorded one and every override pass this same check."""
        for key in ("round_timeout", "node_wait"):
            if not (math.isfinite(getattr(self, key)) and getattr(self, key) > 0):
                return f"{key} must be a finite number of seconds > 0, got {getattr(self, key)}"
        if self.min_nodes is not None and self.min_nodes < 1:
            return f"min_nodes must be at least 1, got {self.min_nodes}"
        if self.round_retries < 1:
            return f"round_retries must be at least 1, got {self.round_retries}"
        if self.max_update_norm is not None and not (math.isfinite(self.max_update_norm) and self.max_update_norm > 0):
            return f"max_update_norm must be a finite number > 0, got {self.max_update_norm}"
        if self.edge_max_examples < 1:
            return f"edge_max_examples must be at least 1, got {self.edge_max_examples}"
        if self.site_max_examples < 1:
            return f"site_max_examples must be at least 1, got {self.site_max_examples}"
        if self.max_staleness < 0:
            return f"max_staleness must be 0 or more, got {self.max_staleness}"
        if not (math.isfinite(self.staleness_exponent) and self.staleness_exponent >= 0):
            return f"staleness_exponent must be a finite number >= 0, got {self.staleness_exponent}"
        if not (math.isfinite(self.server_lr) and self.server_lr > 0):
            return f"server_lr must be a finite number > 0, got {self.server_lr}"
        if self.mode not in MODES:
            return f"mode must be 'sync' or 'buffered', got {self.mode!r}"
        if self.concurrency < 1 or self.buffer_size < 1:
            return f"concurrency and buffer_size must be at least 1, got {self.concurrency} and {self.buffer_size}"
        if self.update_norm_action not in NORM_ACTIONS:
            return f"update_norm_action must be 'reject' or 'clip', got {self.update_norm_action!r}"
        return None

    def record(self) -> dict[str, Any]:
        """What config.json's ``server`` holds: every key, defaults included (a reader never supplies one)."""
        return dataclasses.asdict(self)

    def subset(self, keys: tuple[str, ...]) -> dict[str, Any]:
        return {key: getattr(self, key) for key in keys}

    def with_overrides(self, overrides: dict[str, Any], where: str) -> "ServerSpec":
        """This record with run-time values (None: keep the record's), checked like the record itself."""
        given = {k: v for k, v in overrides.items() if v is not None}
        return ServerSpec.from_record({**self.record(), **given}, where)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_record(cls, record: Any, where: str) -> "ServerSpec":
        """A server table as recorded (config.json ``server``) or overridden; every key must be present
        (a record lacking keys is migrated first: ``fedmvp.runs``). ``ServerRecordError`` names ``where``."""
        if not isinstance(record, dict):
            raise ServerRecordError(f"{where}: the server record must be an object, got {type(record).__name__}")
        names = cls.keys()
        unknown = sorted(set(record) - set(names))
        missing = [k for k in names if k not in record]
        if unknown or missing:
            raise ServerRecordError(f"{where}: server record: " + "; ".join(
                ([f"unknown key {unknown[0]!r}"] if unknown else []) + ([f"missing key {missing[0]!r}"] if missing
                                                                         else [])))
        hints = typing.get_type_hints(cls)
        values = {}
        for key in names:
            value = record[key]
            if not type_ok(value, hints[key]):
                raise ServerRecordError(f"{where}: server {key} must be {type_name(hints[key])}, got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ServerRecordError(f"{where}: server {key} must be a finite number, got {value!r}")
            values[key] = float(value) if is_float(hints[key]) and value is not None else value
        spec = cls(**values)
        problem = spec.problem()
        if problem:
            raise ServerRecordError(f"{where}: server {problem}")
        return spec
