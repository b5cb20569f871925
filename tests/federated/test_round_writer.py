"""The one round lifecycle (fedmvp/federated/round_writer.py): a synchronous round run by the strategy's
own ``start`` is written with who never replied and how long it took; the record's JSON is state.json's."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedmvp.federated.aggregate import Update
from fedmvp.federated.round_writer import RoundFailed, RoundRecord, RoundWriter
from fedmvp.federated.strategy import FedMVPStrategy, RoundPolicy, StrategyOptions
from fedmvp.federated.wire import array_record
from fedmvp.presets.server import ServerSpec
from fedmvp.runs import RunDir
from tests.federated.test_aggregation import RUN, _flower_run_identity  # noqa: F401
from tests.federated.test_privacy_rounds import THETA, BufferedGrid


def one_round_strategy(path, round_timeout: float) -> tuple[RunDir, FedMVPStrategy]:
    """A one-round run on one edge-device site that saves its round under ``path``."""
    run = RunDir(path)
    run.write_config({"rounds": 1})
    options = StrategyOptions(client_config={"method": {"m": 1}}, seed=0, total_rounds=1, base_lr=0.1,
                              num_clients=1, run_id=RUN,
                              policy=RoundPolicy(1.0, ServerSpec(min_nodes=1, node_wait=5,
                                                                 round_timeout=round_timeout)))
    return run, FedMVPStrategy(options, RoundWriter(run, options.policy.server))


def test_a_round_records_the_device_that_never_replied_and_its_seconds(tmp_path):
    run, strategy = one_round_strategy(tmp_path, 0.5)
    evaluated = []
    strategy.evaluate_round = lambda grid, state, number: evaluated.append(number) or {}
    strategy.start(BufferedGrid({7: 0, 8: 10 ** 9}), array_record(THETA), num_rounds=1)  # node 8 never replies
    state = json.loads((run.round_path(1) / "state.json").read_text())
    assert state["timed_out"] == ["edge node 8"] and 0 < state["seconds"] < 30
    assert [r["node"] for r in state["replies"]] == [7] and state["method"] == {"m": 1}
    assert evaluated == [1]  # the last round is evaluated before it is saved
    assert list(state)[:9] == ["lora_clients", "seed", "lr", "total_rounds", "method", "sites", "replies",
                               "rejected", "metrics"]


def test_an_ingested_record_keeps_its_base_rounds_keys_in_place():
    carried = {"lora_clients": [0], "sites": [], "replies": [], "metrics": {"round": 1}, "timed_out": ["a"]}
    record = RoundRecord(2, {"round": 2, "source": "ingest"}, carried=carried, seconds=0.5,
                         ingest={"source": "ingest", "ingested_onto": 1, "ingest_rules": {}, "ingest": []})
    assert list(record.to_json().items()) == [
        ("lora_clients", [0]), ("sites", []), ("replies", []), ("metrics", {"round": 2, "source": "ingest"}),
        ("timed_out", []), ("source", "ingest"), ("ingested_onto", 1), ("ingest_rules", {}), ("ingest", []),
        ("seconds", 0.5)]


def test_an_update_that_does_not_fit_the_state_is_refused_before_the_rule():
    writer = RoundWriter()
    theta = {"lora.a": np.zeros(3, np.float32)}
    with pytest.raises(RoundFailed, match="round 4: update 0 sends lora.a with shape"):
        writer.apply("round 4", theta, [Update({"lora.a": np.zeros(2, np.float32)}, 1)])
    with pytest.raises(RoundFailed, match="round 4: update 0 holds NaN or infinite values in lora.a"):
        writer.apply("round 4", theta, [Update({"lora.a": np.full(3, np.nan, np.float32)}, 1)])


class SuperLinkAnswers(BufferedGrid):
    """Node 8 stopped its heartbeat: the SuperLink (node 1) answers its message with an error, as Flower does."""

    def pull_messages(self, ids):
        ids = list(ids)
        gone = [i for i in ids if i in self.out and self.out[i].metadata.dst_node_id == 8]
        replies = list(super().pull_messages([i for i in ids if i not in gone]))
        for message_id in gone:
            from flwr.app import Error, Message

            answer = Message(Error(code=3, reason="Node Unavailable"), reply_to=self.out.pop(message_id))
            answer.metadata._src_node_id = 1
            replies.append(answer)
        return replies


def test_a_node_the_superlink_answers_for_is_left_out_under_its_own_id_and_not_also_timed_out(tmp_path):
    run, strategy = one_round_strategy(tmp_path, 5)
    strategy.evaluate_round = lambda grid, state, number: {}
    strategy.start(SuperLinkAnswers({7: 0, 8: 0}), array_record(THETA), num_rounds=1)
    state = json.loads((run.round_path(1) / "state.json").read_text())
    assert [(r["node"], "Node Unavailable" in r["reason"]) for r in state["rejected"]] == [(8, True)]
    assert state["timed_out"] == [] and [r["node"] for r in state["replies"]] == [7]
