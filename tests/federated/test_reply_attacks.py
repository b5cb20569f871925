"""Flower replies as a hostile SuperNode sends them: each is left out with a logged reason, nothing averaged.

Rows are real Flower records (the message's one ConfigRecord of folded records, fedmvp_formats.envelope:
the packed .npy bytes as they arrive off the wire, their ``layout``, ``metrics``, ``identity``, ``classes``;
or records beside it) in a real ``Message``, handed to the
strategy's ``aggregate_train`` beside one good reply: the round must average exactly the good one,
record the hostile one's reason (one printable line, bounded) and raise nothing. Arrays must be
refused by their declared shape and bytes before anything is converted (tracemalloc: no copy).
"""

from __future__ import annotations

import io
import logging
import tracemalloc
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from fedmvp_formats.envelope import fold

from fedmvp_formats.class_set import ClassSet
from fedmvp.federated.replies import ClassRules
from fedmvp.federated.strategy import FedMVPStrategy, RoundPolicy, StrategyOptions
from fedmvp.presets.server import ServerSpec

RUN = "run-1"
SHAPE = (2, 3)
ANSI = "\x1b[31m\nFAKE accepted\x1b[0m\r"
MAX_REASON = 300


@pytest.fixture(autouse=True)
def _flower_run_identity():
    """Messages are built inside a Flower run; outside one, give them a run id."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield


def npy(array: np.ndarray | None = None, *, descr: str = "<f4", shape: tuple = SHAPE, payload: bytes | None = None,
        fortran: bool = False) -> bytes:
    """.npy bytes; with ``payload`` the header says ``descr``/``shape`` whatever the bytes are."""
    if array is not None:
        stream = io.BytesIO()
        np.save(stream, array, allow_pickle=False)
        return stream.getvalue()
    header = repr({"descr": descr, "fortran_order": fortran, "shape": shape}).encode()
    header += b" " * (63 - (10 + len(header)) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + (payload or b"")


FLAT = (6,)  # lora.a [2, 3], packed


def wire(data: bytes | None = None) -> bytes:
    """The packed bytes as they arrive: whatever the sender chose (good: the 6 float32 ones of lora.a)."""
    return npy(np.ones(FLAT, np.float32)) if data is None else data


def layout(*tensors: tuple[str, tuple]) -> dict[str, list]:
    """A layout record's values for ``(name, shape)`` pairs (fedmvp_formats.packed)."""
    return {"names": [n for n, _ in tensors], "ranks": [len(s) for _, s in tensors],
            "dims": [d for _, s in tensors for d in s]}


GOOD_LAYOUT = layout(("lora.a", SHAPE))


@dataclass(frozen=True)
class Hostile:
    """A reply from site 1 (node 101): what it changes of a good reply, and the reason fragment."""

    id: str
    reason: str
    arrays: dict[str, Any] | None = None  # replaces the arrays record's values (good: one packed bytes)
    layout: dict[str, Any] | None = None  # replaces the layout record's values
    metrics: dict[str, Any] = field(default_factory=dict)  # merged into the good metrics (None: drop key)
    identity: dict[str, Any] = field(default_factory=dict)  # merged into the good identity (None: drop key)
    records: dict[str, Any] = field(default_factory=dict)  # replaces whole records (None: drop the record;
    # a ConfigRecord: its values, folded; a MetricRecord: a record of its own beside the one ConfigRecord)
    folded: dict[str, Any] = field(default_factory=dict)  # keys written into the one ConfigRecord as they are
    edge: bool = False


def packed(data: bytes) -> dict[str, bytes]:
    return {"tensors": data}


def _many() -> dict[str, Any]:
    return layout(("lora.a", SHAPE), *((f"lora.z{i:05d}", (1,)) for i in range(2000)))


ROWS = [
    # the layout: names and shapes first, against the round's
    Hostile("4-TiB-declared", "1099511627776 values declared", layout=layout(("lora.a", (2 ** 40,)))),
    Hostile("2**64-wraps-int64", "18446744073709551616 values declared", layout=layout(("lora.a", (2 ** 32, 2 ** 32)))),
    Hostile("1-GiB-wrong-shape", "shape [268435456], the round's is [2, 3]", layout=layout(("lora.a", (2 ** 28,)))),
    Hostile("wrong-shape", "shape [3, 2]", layout=layout(("lora.a", (3, 2)))),
    Hostile("scalar", "shape []", layout=layout(("lora.a", ()))),
    Hostile("1000-dimensions", "ranks", layout=layout(("lora.a", (1,) * 1000))),
    Hostile("2000-names", "and 1997 more", layout=_many()),
    Hostile("ansi-name", "unexpected", layout=layout(("lora.a", SHAPE), (f"lora.{ANSI}", SHAPE))),
    Hostile("duplicate-names", "distinct", layout=layout(("lora.a", SHAPE), ("lora.a", SHAPE))),
    Hostile("names-not-strings", "names", layout={**GOOD_LAYOUT, "names": [7]}),
    Hostile("negative-dim", "dims", layout={**GOOD_LAYOUT, "dims": [-2, -3]}),
    Hostile("float-dims", "dims", layout={**GOOD_LAYOUT, "dims": [2.0, 3.0]}),
    Hostile("dims-do-not-fit", "do not fit", layout={**GOOD_LAYOUT, "dims": [2]}),
    Hostile("extra-layout-key", "expected the keys", layout={**GOOD_LAYOUT, "offsets": [0]}),
    Hostile("no-layout", "no layout", records={"layout": None}),
    Hostile("layout-as-metric-record", "expected one fedmvp ConfigRecord, got 2 record(s)",
            records={"layout": None, "layout-beside": MetricRecord({"ranks": [2]})}),
    # the one record itself
    Hostile("record-beside-the-one", "expected one fedmvp ConfigRecord", records={"extra": ConfigRecord({"a": 1})}),
    Hostile("unfolded-key", "fedmvp key tensors is not <record>.<key>", folded={"tensors": b"x"}),
    Hostile("ansi-unfolded-key", "is not <record>.<key>", folded={ANSI: 1}),
    # the packed bytes, before they are converted
    Hostile("two-arrays", "expected one tensors value", arrays={**packed(wire()), "lora.a": wire()}),
    Hostile("per-name-arrays", "expected one tensors value", arrays={"lora.a": wire()}),
    Hostile("tensors-as-text", "is not bytes", arrays={"tensors": "x" * 24}),
    Hostile("tensors-as-list", "is not bytes", arrays={"tensors": [1.0] * 6}),
    Hostile("npy-header-lies-4-TiB", ".npy", packed(wire(npy(shape=(2 ** 40,), payload=b"x" * 24)))),
    Hostile("16-MB-array", "16000128 bytes", packed(wire(npy(np.ones(4_000_000, np.float32))))),
    Hostile("float64", "they hold float64", packed(wire(npy(np.ones(FLAT, np.float64))))),
    Hostile("float16", "they hold float16", packed(wire(npy(np.ones(FLAT, np.float16))))),
    Hostile("big-endian-float32", ".npy", packed(wire(npy(np.ones(FLAT, ">f4"))))),
    Hostile("int32", "they hold int32", packed(wire(npy(np.ones(FLAT, np.int32))))),
    Hostile("int64", "they hold int64", packed(wire(npy(np.ones(FLAT, np.int64))))),
    Hostile("bool", "they hold bool", packed(wire(npy(np.ones(FLAT, bool))))),
    Hostile("complex64", "they hold complex64", packed(wire(npy(np.ones(FLAT, np.complex64))))),
    Hostile("object-pickle", ".npy", packed(wire(npy(descr="|O", payload=b"\x80\x04N.")))),
    Hostile("object-declared-shape", ".npy", packed(wire(npy(descr="|O", shape=FLAT, payload=b"\x80\x04N.")))),
    Hostile("fortran-2d-header", ".npy", packed(wire(npy(np.ones(SHAPE, np.float32))))),
    Hostile("truncated-bytes", ".npy", packed(wire(npy(np.ones(FLAT, np.float32))[:-5]))),
    Hostile("not-npy", ".npy", packed(wire(b"\x80\x04\x95" + b"x" * 40))),
    # metrics and identity
    Hostile("no-metrics", "malformed reply", records={"metrics": None}),
    Hostile("metrics-as-strings", "malformed reply (metrics num-examples: '8' is not a number", records={"metrics": ConfigRecord(
        {"num-examples": "8", "partition-id": 1, "train-loss": 0.5})}),
    Hostile("metrics-bytes", "is not a number", metrics={"train-ce": b"0.4"}),
    Hostile("num-examples-only-in-identity", "train-loss", metrics={"num-examples": None, "train-loss": None},
            identity={"num-examples": 8}),
    Hostile("identity-and-metrics-disagree", "disagree on num-examples", metrics={"num-examples": 10 ** 9},
            identity={"num-examples": 8}),
    Hostile("num-examples-float", "not a positive integer", metrics={"num-examples": 8.0}),
    Hostile("num-examples-2.5", "not a positive integer", metrics={"num-examples": 2.5}),
    Hostile("num-examples-negative", "not a positive integer", metrics={"num-examples": -3}),
    Hostile("num-examples-nan", "not a positive integer", metrics={"num-examples": float("nan")}),
    Hostile("num-examples-inf", "not a positive integer", metrics={"num-examples": float("inf")}),
    Hostile("num-examples-list", "not a positive integer", metrics={"num-examples": [8]}),
    Hostile("num-examples-2**70", "exceeds the site's 10", metrics={"num-examples": 2 ** 70}),
    Hostile("train-loss-nan", "train-loss", metrics={"train-loss": float("nan")}),
    Hostile("train-loss-inf", "train-loss", metrics={"train-loss": float("-inf")}),
    Hostile("train-loss-list", "train-loss", metrics={"train-loss": [0.1, 0.2]}),
    Hostile("train-loss-absent", "train-loss", metrics={"train-loss": None}),
    Hostile("lora-active-nan", "lora-active", metrics={"lora-active": float("nan")}),
    Hostile("switch-next-7", "switch-next", metrics={"switch-next": 7}),
    Hostile("run-id-1MB", "run-id 'rrr", identity={"run-id": "r" * (1 << 20)}),
    Hostile("run-id-ansi", "reply of another run", identity={"run-id": ANSI}),
    # a site that trained with another attribute file (other classes, order or phrases) says so in its identity
    Hostile("classes-digest-other", "reply of another class set", identity={"classes-digest": "c" * 64}),
    Hostile("classes-digest-ansi", "reply of another class set", identity={"classes-digest": ANSI}),
    Hostile("classes-digest-1MB", "classes-digest 'ccc", identity={"classes-digest": "c" * (1 << 20)}),
    Hostile("run-id-bytes", "run-id b'run-1' is not a string", identity={"run-id": RUN.encode()}),
    Hostile("partition-id-1MB", "unknown site", identity={"partition-id": "1" * (1 << 20)},
            metrics={"partition-id": None}),
    Hostile("partition-id-float", "unknown site", identity={"partition-id": 1.0}, metrics={"partition-id": None}),
    Hostile("round-string", "reply of round '1'", identity={"round": "1"}),
    Hostile("round-float", "reply of round 1.0", identity={"round": 1.0}),
    Hostile("edge-refresh-bytes-string", "refresh-bytes", identity={"refresh-bytes": "x"}, edge=True),
    Hostile("edge-refresh-bytes-negative", "refresh-bytes", identity={"refresh-bytes": -5}, edge=True),
    Hostile("edge-bundle-id-1MB", "bundle-id", identity={"bundle-id": "b" * (1 << 20)}, edge=True),
    Hostile("edge-digest-list", "promptformer-digest", identity={"promptformer-digest": ["d1"]}, edge=True),
    Hostile("edge-role-ansi", "is not site or edge", identity={"role": ANSI}, edge=True),
    Hostile("edge-refreshed-2", "refreshed 2 is not 0 or 1", identity={"refreshed": 2}, edge=True),
    Hostile("no-identity", "unknown site None", records={"identity": None}, metrics={"partition-id": None}),
    # the classes a site says it trained on (class name -> training images)
    Hostile("no-classes", "no classes record", records={"classes": None}),
    Hostile("classes-as-a-metric-record", "expected one fedmvp ConfigRecord",
            records={"classes": None, "classes-beside": MetricRecord({"cat": 8})}),
    Hostile("classes-also-in-metrics", "a record of its own", metrics={"classes": 8}),
    Hostile("classes-count-float", "classes cat: 8.0 is not a count of images", records={"classes": ConfigRecord({"cat": 8.0})}),
    Hostile("classes-count-negative", "is not a count of images", records={"classes": ConfigRecord({"cat": 9, "dog": -1})}),
    Hostile("classes-count-bool", "is not a count of images", records={"classes": ConfigRecord({"cat": True})}),
    Hostile("classes-count-list", "is not a count of images", records={"classes": ConfigRecord({"cat": [8]})}),
    Hostile("classes-sum-differs", "classes count 7 images, num-examples 8", records={"classes": ConfigRecord({"cat": 7})}),
    Hostile("classes-not-its-own", "'zebra' is not in site 1's classes", records={"classes": ConfigRecord({"zebra": 8})}),
    Hostile("classes-held-out-new", "'seven' is not in site 1's classes", records={"classes": ConfigRecord({"seven": 8})}),
    Hostile("classes-ansi-name", "is not in site 1's classes", records={"classes": ConfigRecord({ANSI: 8})}),
    Hostile("edge-classes-unknown", "'zebra' is not in the federation's class set", edge=True,
            records={"classes": ConfigRecord({"zebra": 8})}),
]


def message(node: int, site: int, arrays: dict[str, Any], row: Hostile | None = None) -> Message:
    """A train reply of ``site`` (or an edge device) from ``node``, changed as ``row`` says."""
    row = row or Hostile("good", "")
    metrics = {"num-examples": 8, "train-loss": 0.5, "train-ce": 0.4, "train-consistency": 0.1,
               "lora-active": 1, "switch-next": 0, **({} if row.edge else {"partition-id": site})}
    identity = {"round": 1, "run-id": RUN, **({"role": "edge", "bundle-id": "b" * 64, "promptformer-digest": "d1",
                                                "refreshed": 0, "refresh-bytes": 0} if row.edge
                                               else {"partition-id": site})}
    metrics = {k: v for k, v in (metrics | row.metrics).items() if v is not None}
    identity = {k: v for k, v in (identity | row.identity).items() if v is not None}
    records = {"arrays": row.arrays or arrays, "layout": row.layout or GOOD_LAYOUT, "metrics": metrics,
               "identity": identity, **({} if row.edge else {"classes": {"cat": 8}})} | row.records
    beside = {k: v for k, v in records.items() if isinstance(v, MetricRecord)}
    one = fold({k: dict(v) for k, v in records.items() if v is not None and k not in beside}) | row.folded
    # a row naming a ConfigRecord of its own in ``records`` beyond the schema's: kept beside the one record
    beside |= {k: v for k, v in row.records.items() if isinstance(v, ConfigRecord) and k not in
               ("metrics", "classes", "identity", "layout", "arrays")}
    one = {k: v for k, v in one.items() if k.partition(".")[0] not in beside}
    msg = Message(content=RecordDict({"fedmvp": ConfigRecord(one), **beside}), dst_node_id=1, message_type="train")
    msg.metadata._src_node_id = node
    return msg


# The run record's classes: both sites hold cat and dog; "seven" is a held-out new class (evaluated only).
CLASS_RULES = ClassRules.from_record({"clients": [{"id": 0, "classes": ["cat", "dog"]}, {"id": 1, "classes": ["cat", "dog"]}],
                                      "evaluations": [{"classes": ["cat", "dog"]}, {"classes": ["seven"]}]})


def strategy() -> FedMVPStrategy:
    made = FedMVPStrategy(StrategyOptions(client_config={"class_set": ClassSet.of([("cat", ["fur"]), ("dog", ["tail"])]).record()},
                          seed=0, total_rounds=2, base_lr=0.1, num_clients=2, run_id=RUN,
                          declared_examples={0: 10, 1: 10}, lora_clients=[0, 1], class_rules=CLASS_RULES,
                          policy=RoundPolicy(server=ServerSpec(min_nodes=1))))
    made.global_state = {"promptformer.w": np.zeros(2, np.float32), "lora.a": np.zeros(SHAPE, np.float32)}
    return made


GOOD = np.full(SHAPE, 0.25, np.float32)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_a_hostile_reply_is_left_out_and_nothing_of_it_averaged(row: Hostile, caplog) -> None:
    server = strategy()
    replies = [message(100, 0, packed(npy(GOOD.ravel()))), message(101, 1, packed(wire()), row)]
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING):
            arrays, metrics = server.aggregate_train(1, replies)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak  # nothing the hostile reply declared was materialised
    assert np.array_equal(arrays["lora.a"].numpy(), GOOD) and metrics["clients"] == 1
    assert metrics["train-loss"] == 0.5
    [rejected] = server.rejected
    reason = rejected["reason"]
    assert rejected["node"] == 101 and row.reason in reason, reason[:2000]
    assert reason.isprintable() and len(reason) <= MAX_REASON, repr(reason[:2000])
    assert any("node 101" in r.getMessage() and reason in r.getMessage() for r in caplog.records)
    assert 101 not in server.known


def test_the_good_reply_alone_is_accepted() -> None:
    """The rows' baseline: the same reply unchanged from site 1 counts."""
    server = strategy()
    arrays, metrics = server.aggregate_train(1, [message(100, 0, packed(npy(GOOD.ravel()))),
                                                 message(101, 1, packed(wire()))])
    assert server.rejected == [] and metrics["clients"] == 2
    np.testing.assert_allclose(arrays["lora.a"].numpy(), (GOOD + 1) / 2)


def test_each_sites_classes_are_recorded_with_its_reply_and_an_edge_device_need_not_say() -> None:
    """The round's state.json lists each accepted reply with what it trained on (class -> images)."""
    server = strategy()
    edge = message(102, 0, packed(wire()), Hostile("edge", "", edge=True))
    with_classes = message(101, 1, packed(wire()), Hostile("two-classes", "",
                                                                records={"classes": ConfigRecord({"dog": 3, "cat": 5})}))
    server.aggregate_train(1, [message(100, 0, packed(npy(GOOD.ravel()))), with_classes, edge])
    summary = server.written.to_json()
    assert server.rejected == []
    assert [(r["role"], r.get("classes")) for r in summary["replies"]] == [
        ("site", {"cat": 8}), ("site", {"dog": 3, "cat": 5}), ("edge", None)]


# ---- evaluation replies: the counts a node reports, checked before they are combined ----------------------
EVAL_COUNTS = {"local:correct": 3, "local:total": 4, "shapes/new:correct": 1, "shapes/new:total": 2}


@pytest.mark.parametrize("change,kept", [
    ({}, {"local": (3, 4), "shapes/new": (1, 2)}),
    ({"local:correct": float("nan")}, {"shapes/new": (1, 2)}),
    ({"local:correct": float("inf")}, {"shapes/new": (1, 2)}),
    ({"local:total": 4.0}, {"shapes/new": (1, 2)}),
    ({"local:correct": -1}, {"shapes/new": (1, 2)}),
    ({"local:correct": 5}, {"shapes/new": (1, 2)}),
    ({"local:correct": True}, {"shapes/new": (1, 2)}),
    ({"local:total": [4]}, {"shapes/new": (1, 2)}),
    ({"shapes/other:correct": 1, "shapes/other:total": 1}, {"local": (3, 4), "shapes/new": (1, 2)}),  # not its set
], ids=["good", "nan", "inf", "float", "negative", "more-than-total", "bool", "list", "unassigned-set"])
def test_a_sites_evaluation_counts_are_kept_only_when_they_make_sense(change, kept):
    """A NaN count used to stop the server (int(nan) raised inside the strategy); now that set is left out."""
    from fedmvp.federated.replies import site_counts

    assert site_counts({**EVAL_COUNTS, **change}, {"shapes/new": 0, "shapes/other": 1}, 0) == kept


@pytest.mark.parametrize("metrics,identity,pair", [
    ({"edge:correct": 2, "edge:total": 5}, {}, (2, 5)),
    ({"edge:correct": float("nan"), "edge:total": 5}, {}, None),
    ({"edge:correct": 2.0, "edge:total": 5}, {}, None),
    ({"edge:correct": 6, "edge:total": 5}, {}, None),
    ({"edge:correct": 2, "edge:total": 5}, {"round": 2}, None),
    ({"edge:correct": 2, "edge:total": 5}, {"run-id": "other"}, None),
], ids=["good", "nan", "float", "more-than-total", "other-round", "other-run"])
def test_an_edge_devices_evaluation_counts(metrics, identity, pair):
    from fedmvp.federated.replies import edge_counts

    assert edge_counts({"role": "edge", "run-id": "r1", "round": 1, **identity}, metrics, "r1", 1) == pair
