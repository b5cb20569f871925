"""Every message and its reply is at most 3 Flower objects: the Message, its RecordDict and the one
ConfigRecord its records are folded into (fedmvp_formats.envelope; docs/benchmarks.md "deploy").

Counted as Flower's push counts them (``message_objects``: the distinct object ids of the tree), on
the messages the real builders make: the server's (``instruction_content``, as the strategies and the
registry call it), a site's ClientApp replies and an edge device's. The real SuperLink's count is
asserted in test_serve_join.py (fedmvp_apps.deploy.object_log)."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MessageType

from fedmvp_formats.class_set import ClassSet
from fedmvp_formats.messages import Identity, Instruction, count_metrics, train_metrics

from fedmvp.federated.site_keys import NONCE, PROOF, PROOF_REQUEST
from fedmvp.federated.wire import array_record, content_records, content_state, instruction_content, message_objects

RNG = np.random.default_rng(1)
LORA = {f"lora.block{i}.{part}": RNG.normal(size=(4, 16)).astype(np.float32) for i in range(4) for part in "ab"}
FULL = {**LORA, **{f"promptformer.t{i:02d}": RNG.normal(size=(8, 16)).astype(np.float32) for i in range(18)}}
BIG = {**LORA, "promptformer.w": np.zeros(12_000_000, np.float32)}  # 48 MB: 10 chunks as a Flower Array
CLASS_SET = ClassSet.of([("cat", ["fur"]), ("dog", ["tail"])]).record()


@pytest.fixture(autouse=True)
def _flower_run_identity():
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield


def train_instruction() -> Instruction:
    return Instruction(round=3, run_id="r", promptformer_digest="d" * 64, preset="demo", lr=0.01, lora_clients=(0, 2),
                       threads=2, method={"lora_rank": 4, "name": "fedmvp"}, local={"epochs": 1, "batch_size": 8},
                       privacy={"clip_norm": 1.0, "mode": "central"}, class_set=CLASS_SET, site=1)


def down(state: dict, instruction: Instruction, kind: str = MessageType.TRAIN, **extra) -> Message:
    return Message(content=instruction_content(array_record(state), instruction, **extra), message_type=kind,
                   dst_node_id=7)


@pytest.mark.parametrize("state", [FULL, LORA, BIG, {}], ids=["full", "lora-only", "48-MB", "no-tensors"])
def test_a_train_message_is_three_objects_whatever_its_tensors(state):
    message = down(state, train_instruction())
    assert message_objects(message) == 3
    assert set(content_state(message.content)) == set(state)
    assert set(content_records(message.content)) >= {"config", "method", "local", "privacy", "class-set"}


def test_an_evaluate_and_an_identify_message_are_three_objects():
    evaluate = down(FULL, Instruction(round=3, run_id="r", method={"name": "fedmvp"}, assignment={"shapes/new": 0},
                                      class_set=CLASS_SET), MessageType.EVALUATE)
    identify = Message(content=instruction_content({}, Instruction(round=3, run_id="r"),
                                                   extra={PROOF_REQUEST: {NONCE: "ab" * 16}}),
                       message_type="query.identify", dst_node_id=7)
    assert message_objects(evaluate) == message_objects(identify) == 3


def test_a_sites_replies_are_three_objects():
    import torch

    from fedmvp.federated.client_app import _reply, _reply_identity

    request = down(FULL, train_instruction())
    identity = Identity(round=3, run_id="r", site=1, name="north", classes_digest="c" * 64)
    state = {k: torch.from_numpy(v) for k, v in FULL.items()}
    train = _reply(request, identity, train_metrics(8, 0.5, ce=0.4, lora_active=True), state, {"cat": 5, "dog": 3})
    evaluate = _reply(request, identity, count_metrics({"local": (3, 4), "shapes/new": (1, 2)}))
    identify = _reply_identity(request, identity, {PROOF: "A" * 140})
    assert [message_objects(m) for m in (train, evaluate, identify)] == [3, 3, 3]
    records = content_records(train.content)
    assert records["classes"] == {"cat": 5, "dog": 3} and records["metrics"]["num-examples"] == 8
    assert set(content_state(train.content)) == set(FULL)


def test_an_edge_devices_replies_are_three_objects():
    from edge_client.node import _reply

    instruction = train_instruction()
    request = down(LORA, instruction)
    train = _reply(request, instruction, None, train_metrics(6, 0.5), LORA)
    evaluate = _reply(request, instruction, None, {"edge:correct": 1, "edge:total": 2})
    assert message_objects(train) == message_objects(evaluate) == 3


def test_the_per_name_encoding_this_replaces_was_many_more():
    """What the count guards against: one Array per tensor, each with its chunk, and records of their own."""
    content = instruction_content(array_record(FULL), train_instruction())
    per_name = content.copy() if hasattr(content, "copy") else content
    per_name["arrays"] = ArrayRecord({k: Array(v) for k, v in FULL.items()})
    assert message_objects(per_name) > 2 * len(FULL)


def test_folded_records_come_back_whatever_their_keys_hold():
    """Record names hold no '.', so the first '.' splits a key: a class name or a metric may hold dots."""
    from fedmvp_formats.envelope import fold, unfold

    records = {"classes": {"st. bernard": 3, "a.b.c": 1}, "metrics": {"local:correct": 2}, "class-set": {"names": ["x"]}}
    assert unfold(fold(records)) == records
    with pytest.raises(ValueError, match="holds '.'"):
        fold({"a.b": {"k": 1}})


@pytest.mark.parametrize("content,reason", [
    ({}, "got 0 record(s)"),
    ({"fedmvp": {"config.round": 1}, "config": {"round": 1}}, "got 2 record(s)"),
    ({"config": {"round": 1}}, "got 1 record(s) (config)"),
    ({"fedmvp": {"round": 1}}, "fedmvp key round is not <record>.<key>"),
    ({"fedmvp": {".round": 1}}, "is not <record>.<key>"),
    ({"fedmvp": {"config.": 1}}, "is not <record>.<key>"),
], ids=["empty", "two-records", "another-name", "unfolded", "no-record-name", "no-key"])
def test_a_content_that_is_not_one_folded_config_record_is_refused_in_one_line(content, reason):
    from flwr.app import ConfigRecord, RecordDict

    from fedmvp_formats.messages import MessageError

    with pytest.raises(MessageError, match=reason.replace("(", r"\(").replace(")", r"\)")) as err:
        content_records(RecordDict({k: ConfigRecord(v) for k, v in content.items()}))
    assert "\n" not in str(err.value)


def test_a_metric_record_in_place_of_the_config_record_is_refused():
    from flwr.app import MetricRecord, RecordDict

    from fedmvp_formats.messages import MessageError

    with pytest.raises(MessageError, match="expected one fedmvp ConfigRecord"):
        content_records(RecordDict({"fedmvp": MetricRecord({"metrics.num-examples": 8})}))
