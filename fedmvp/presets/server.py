"""The server rules: how rounds run across machines and which replies and update files count.

ONE definition of their names, defaults, ranges and help (docs/architecture.md, "Records that
travel"): the preset's ``[server]`` table is parsed into ``ServerSpec``, config.json records it
whole (``server``), and the strategy (``RoundPolicy``), the reply checks (``ReplyRules``) and
`fedmvp ingest` read that record back through ``ServerSpec.from_record``. `fedmvp serve` flags and
`fedmvp ingest --max-staleness` are overrides of this one record, checked by the same ranges
(the record base, ``fedmvp_formats.record``: each field's checks are declared with it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedmvp_formats.record import Bound, OneOf, Record, record_field

NORM_ACTIONS = ("reject", "clip")
MODES = ("sync", "buffered")
_SECONDS = Bound(0, above=True, finite=True, says="a finite number of seconds > 0", shows=str)
_POSITIVE = Bound(0, above=True, finite=True, shows=str)


class ServerRecordError(ValueError):
    """A server record or override out of type or range; the message names where and the key."""


@dataclass(frozen=True)
class ServerSpec(Record):
    """How the server runs rounds across machines and which replies it accepts (docs/architecture.md)."""

    ERROR = ServerRecordError
    NAME = "server record"
    PREFIX = "server "

    min_nodes: int | None = record_field(None, "replies a round needs (and nodes that must be connected before it "
                                             "starts); default: the clients sampled per round", Bound(1))
    round_timeout: float = record_field(3600.0, "seconds a round waits for replies; then it closes with what came "
                                              "back if at least min_nodes did, else it is tried again", _SECONDS)
    node_wait: float = record_field(600.0, "seconds to wait for min_nodes connected nodes before giving up", _SECONDS)
    round_retries: int = record_field(3, "tries of a round that got fewer than min_nodes replies", Bound(1))
    max_update_norm: float | None = record_field(None, "largest L2 distance of a reply's tensors to the round's "
                                                     "global tensors (none: no bound)", _POSITIVE)
    max_update_rms: float = record_field(10.0, "where max_update_norm is unset, the bound every update still has: "
                                               "this times the square root of the values it sends (a root mean "
                                               "square change of 10 per value is no training: weights sit within "
                                               "+-1)", _POSITIVE)
    update_norm_action: str = record_field("reject", "beyond max_update_norm: 'reject' the reply or 'clip' it onto "
                                                   "the bound", OneOf(NORM_ACTIONS))
    edge_max_examples: int = record_field(10000, "most images an edge device's reply or update file may count (its "
                                               "FedAvg weight); a site's bound is its own training set", Bound(1))
    site_max_examples: int = record_field(10000, "most images a [federation] site's reply may count when the server "
                                               "cannot bound its training set (shots unset: the site's own folder, "
                                               "which the server never sees)", Bound(1))
    count_cap: float = record_field(3.0, "an update's example count weighs at most this times the median count of "
                                         "the round's updates, whatever it claims (0: no cap; "
                                         "fedmvp/federated/count_cap.py)", Bound(0, finite=True, shows=str))
    max_staleness: int = record_field(5, "`fedmvp ingest`: rounds an update's bundle may be behind the run's "
                                       "last round (0: only updates of bundles exported from that round); "
                                       "mode = 'buffered': versions a reply's base may be behind", Bound(0))
    staleness_exponent: float = record_field(0.5, "a in s(t) = (1 + t)^(-a): an update t rounds behind the state it "
                                                "is applied to moves it s(t) times what a fresh one would (0: no "
                                                "discount)", Bound(0, finite=True, shows=str))
    server_lr: float = record_field(1.0, "eta: the server applies eta times the weighted mean of the updates' "
                                       "deltas (1: FedAvg when every update is fresh)", _POSITIVE)
    mode: str = record_field("sync", "'sync': rounds with a barrier (sites and devices); 'buffered': edge devices "
                                   "train asynchronously and a version is written every buffer_size updates "
                                   "(FedBuff; `fedmvp serve` only)", OneOf(MODES))
    update_rule: str = record_field("fedavg", "the server's update rule by name (fedmvp/federated/update_rules.py) "
                                              "for rounds with a site's update: 'fedavg', the staleness-weighted "
                                              "FedAvg of the updates' deltas; robust rules (docs/howto/robust.md): "
                                              "'norm_clip', 'trimmed_mean', 'median', 'multi_krum' (refused with "
                                              "[privacy] mode = 'central'); set to a robust rule, device rounds "
                                              "follow it too unless device_rule is set")
    device_rule: str | None = record_field(None, "the update rule of rounds whose updates all come from edge "
                                                 "devices (`fedmvp ingest`, buffered versions, a served round of "
                                                 "devices only); default: update_rule where that is not 'fedavg', "
                                                 "else 'norm_clip', or 'fedavg' under [privacy] mode = 'central' "
                                                 "(docs/howto/robust.md, \"Devices: a robust default\")")
    concurrency: int = record_field(4, "mode = 'buffered': edge devices kept training at once")
    buffer_size: int = record_field(2, "mode = 'buffered': accepted device updates that make the next version")
    # -- the robust update rules' keys (fedmvp/federated/robust_rules.py, docs/howto/robust.md)
    robust_clip_factor: float = record_field(2.0, "update_rule = 'norm_clip': each (staleness-discounted) delta is "
                                                "clipped to this times the median of the round's delta norms",
                                             _POSITIVE)
    trim_fraction: float = record_field(0.1, "update_rule = 'trimmed_mean': the share of the updates dropped at each "
                                           "end per coordinate (at least 1 when > 0 and 3 or more updates)",
                                        Bound(0, 0.5, below=True, shows=str))
    assumed_malicious: int = record_field(1, "update_rule = 'multi_krum': f, the attackers assumed among a round's "
                                           "n updates; the n - f with the lowest Krum scores are averaged (its "
                                           "guarantee needs n >= 2 f + 3)", Bound(0))
    # Dropouts and over-selection (docs/howto/buffered.md, "Dropouts and over-selection")
    over_selection: float = record_field(1.0, "edge devices sent work per device wanted (1.3: 130%, as device "
                                              "fleets over-select for their dropouts): 'sync': ceil(factor x the "
                                              "round's devices) are sent work, the round closes once the wanted "
                                              "number replied and later ones are discarded as late; 'buffered': "
                                              "ceil(factor x concurrency) devices kept busy",
                                         Bound(1, finite=True, shows=str))
    min_buffer: int | None = record_field(None, "mode = 'buffered': a version that has gathered for round_timeout "
                                                "seconds is written with the updates that arrived if there are at "
                                                "least this many (default: buffer_size, i.e. never early)", Bound(1))

    @classmethod
    def cross_problem(cls, values: Mapping[str, Any]) -> str | None:
        """The buffered mode's two sizes, said together."""
        if values["concurrency"] < 1 or values["buffer_size"] < 1:
            return (f"concurrency and buffer_size must be at least 1, got {values['concurrency']} and "
                    f"{values['buffer_size']}")
        if values["min_buffer"] is not None and values["min_buffer"] > values["buffer_size"]:
            return f"min_buffer must be at most buffer_size {values['buffer_size']}, got {values['min_buffer']}"
        return None

    @classmethod
    def not_a_record(cls, where: str, record: Any) -> str:
        return f"{where}: the server record must be an object, got {type(record).__name__}"

    @classmethod
    def shape_problem(cls, where: str, missing: list[str], unknown: list[str]) -> str:
        """The first unknown and the first missing key (a record lacking keys is migrated first:
        ``fedmvp.runs``)."""
        return f"{where}: server record: " + "; ".join(
            ([f"unknown key {unknown[0]!r}"] if unknown else []) + ([f"missing key {missing[0]!r}"] if missing
                                                                     else []))
