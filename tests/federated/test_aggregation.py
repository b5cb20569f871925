"""Per-tensor weighted FedAvg over replies with different tensor sets (LoRA-only and full clients)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message

from fedmvp.federated.metrics import harmonic_mean
from fedmvp.federated.aggregate import weighted_average
from fedmvp.federated.strategy import FedMVPStrategy, RoundFailed, RoundPolicy, StrategyOptions, cosine_lr
from fedmvp.presets.server import ServerSpec
from fedmvp.federated.wire import content_records, content_state, records_content, state_records


@pytest.fixture(autouse=True)
def _flower_run_identity():
    """Messages are built inside a Flower run; outside one, give them a run id."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id = 1
    TaskIdentity.node_id = 0
    TaskIdentity.task_id = 1
    yield


RUN = "run-1"


class SiteGrid:
    """A Grid whose nodes answer the server's identify query: ``roles`` node id -> its site, or "edge"."""

    def __init__(self, roles: dict[int, int | str]):
        self.roles, self.asked = roles, []
        self._replies: list[Message] = []
        self._lock = threading.Lock()

    def get_node_ids(self):
        return list(self.roles)

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for msg in messages:
            assert msg.metadata.message_type == "query.identify"
            node, config = msg.metadata.dst_node_id, content_records(msg.content)["config"]
            self.asked.append(node)
            role = self.roles[node]
            who = {"role": "edge"} if role == "edge" else {"partition-id": role}
            reply = Message(records_content({"identity": {**who, "round": config["round"],
                                                          "run-id": config["run-id"]}}), reply_to=msg)
            reply.metadata._src_node_id = node
            replies.append(reply)
        return replies

    # the two calls the strategy makes (Flower's Grid API): push, then pull the replies, which stay until
    # pulled (the buffered server pulls each in a thread of its own: reply_pulls.py)
    def push_messages(self, messages):
        messages = list(messages)
        for i, msg in enumerate(messages):
            msg.metadata.__dict__["_message_id"] = f"query-{len(self.asked) + i}"
        answered = self.send_and_receive(messages)
        with self._lock:
            self._replies = [*self._replies, *answered]
        return [msg.metadata.message_id for msg in messages]

    def pull_messages(self, ids):
        ids = set(ids)
        with self._lock:
            pulled = [r for r in self._replies if r.metadata.reply_to_message_id in ids]
            self._replies = [r for r in self._replies if r.metadata.reply_to_message_id not in ids]
        return pulled


def reply(client: int, arrays: dict[str, np.ndarray], n: int, lora: bool, switch: bool = False,
          round_number: int = 1, run_id: str = RUN) -> Message:
    metrics = {"num-examples": n, "partition-id": client, "train-loss": 0.1 * (client + 1),
               "train-ce": 0.0, "train-consistency": 0.0, "lora-active": int(lora), "switch-next": int(switch)}
    identity = {"partition-id": client, "round": round_number, "run-id": run_id}
    classes = {f"class{client}": n}  # its training images per class: all of one class
    message = Message(content=records_content({**state_records(arrays), "metrics": metrics, "identity": identity,
                                               "classes": classes}), dst_node_id=1, message_type="train")
    message.metadata._src_node_id = 100 + client  # a reply from node 100 + site (set by Flower in a run)
    return message


def test_weighted_average_is_exact_per_tensor():
    a = {"promptformer.w": np.array([1.0, 2.0], np.float32), "lora.x": np.array([10.0], np.float32)}
    b = {"lora.x": np.array([40.0], np.float32)}
    out = weighted_average([(a, 1.0), (b, 3.0)])
    assert np.array_equal(out["promptformer.w"], np.array([1.0, 2.0], np.float32))  # only a sent it
    assert np.array_equal(out["lora.x"], np.array([(10 * 1 + 40 * 3) / 4], np.float32))


def test_lora_only_and_full_clients_aggregate_in_the_same_round():
    strategy = FedMVPStrategy(StrategyOptions(client_config={"preset": "p.toml"}, seed=0, total_rounds=4, base_lr=0.003,
                              num_clients=3, run_id=RUN, lora_clients=[2]))
    strategy.global_state = {"promptformer.w": np.zeros(2, np.float32), "lora.a": np.zeros(3, np.float32)}
    rng = np.random.default_rng(0)
    full0 = {"promptformer.w": rng.normal(size=2).astype(np.float32)}  # before the switch: the PromptFormer only
    full1 = {"promptformer.w": rng.normal(size=2).astype(np.float32)}
    lora2 = {"lora.a": rng.normal(size=3).astype(np.float32)}
    replies = [reply(2, lora2, 30, lora=True), reply(0, full0, 10, lora=False, switch=True),
               reply(1, full1, 20, lora=False)]
    arrays, metrics = strategy.aggregate_train(1, replies)
    got = {k: v.numpy() for k, v in arrays.items()}
    w0, w1 = (c["promptformer.w"].astype(np.float64) for c in (full0, full1))
    expected_w = (10 * w0 + 20 * w1) / 30
    expected_a = lora2["lora.a"]  # only the LoRA client sent it
    assert np.array_equal(got["promptformer.w"], expected_w.astype(np.float32))
    assert np.array_equal(got["lora.a"], expected_a.astype(np.float32))
    assert strategy.lora_clients == {0, 2}  # client 0 switches from the next round
    assert metrics["lora-uploads"] == 1 and metrics["clients"] == 3
    assert metrics["train-loss"] == pytest.approx((10 * 0.1 + 20 * 0.2 + 30 * 0.3) / 60)


def test_reply_order_does_not_change_the_result():
    rng = np.random.default_rng(1)
    states = [{"lora.a": rng.normal(size=64).astype(np.float32)} for _ in range(5)]
    outs = []
    for order in ([0, 1, 2, 3, 4], [4, 2, 0, 3, 1]):
        strategy = FedMVPStrategy(StrategyOptions(client_config={"preset": "p"}, seed=0, total_rounds=2, base_lr=0.1,
                                  num_clients=5, run_id=RUN, lora_clients=range(5)))
        strategy.global_state = {"lora.a": np.zeros(64, np.float32)}
        arrays, _ = strategy.aggregate_train(1, [reply(i, states[i], 7 + i, lora=True) for i in order])
        outs.append(arrays["lora.a"].numpy())
    assert np.array_equal(outs[0], outs[1])


def test_configure_sends_flags_schedule_and_a_replayable_sample():
    grid = SiteGrid({11: 0, 12: 1, 13: 2, 14: 3})
    strategy = FedMVPStrategy(StrategyOptions(client_config={"preset": "p.toml", "threads": 3}, seed=5, total_rounds=10,
                              base_lr=0.003, num_clients=4, run_id=RUN, policy=RoundPolicy(fraction=0.5),
                              round_offset=4, lora_clients=[3, 1]))
    assert strategy.selected_clients(7) == strategy.selected_clients(7)
    assert len(strategy.selected_clients(7)) == 2
    messages = list(strategy.configure_train(2, ArrayRecord(), ConfigRecord(), grid))
    assert sorted(grid.asked) == [11, 12, 13, 14]  # every node met is asked once who it is
    # only the nodes of the round's sampled sites get work: no broadcast, no empty replies
    assert sorted(m.metadata.dst_node_id for m in messages) == [11 + site for site in strategy.selected_clients(6)]
    config = content_records(messages[0].content)["config"]
    assert config["round"] == 6 and config["run-id"] == RUN and config["threads"] == 3
    assert config["lr"] == pytest.approx(cosine_lr(0.003, 6, 10))
    assert config["lora-clients"] == [1, 3]  # lists travel as lists, not as JSON text
    assert "selected" not in config  # whoever is asked trains
    texts = [v for record in content_records(messages[0].content).values() for v in record.values() if isinstance(v, str)]
    assert not [t for t in texts if t[:1] in "[{"]  # no JSON text in any record
    strategy.configure_train(3, ArrayRecord(), ConfigRecord(), grid)
    assert len(grid.asked) == 4  # a node is asked who it is once


def test_site_sampling_is_the_same_in_simulation_and_deployment_and_replays():
    """The sites of a round depend on (seed, round) alone, whatever node ids serve them."""
    def sent(roles: dict[int, int | str], round_number: int, attempt: int = 0) -> list[int | str]:
        strategy = FedMVPStrategy(StrategyOptions(client_config={}, seed=1, total_rounds=30, base_lr=0.1, num_clients=8, run_id=RUN,
                                  policy=RoundPolicy(fraction=0.25, server=ServerSpec(min_nodes=1))))
        messages = strategy.configure_train(round_number, ArrayRecord(), ConfigRecord(), SiteGrid(roles), attempt)
        return [roles[m.metadata.dst_node_id] for m in messages]

    simulation = {node: node for node in range(8)}
    deployed = {900 - 7 * site: site for site in range(8)} | {5000: "edge", 5001: "edge"}
    for round_number in range(1, 12):
        sites = sent(simulation, round_number)
        assert len(sites) == 2 and sites == sorted(sites)
        assert sorted(s for s in sent(deployed, round_number) if s != "edge") == sites
        assert sent(simulation, round_number, attempt=1) == sites  # a retry asks the same sites
    assert len({tuple(sent(simulation, r)) for r in range(1, 12)}) > 1  # and rounds differ
    assert sent(deployed, 1).count("edge") == 1  # edge devices: the same fraction of them, at least one


def test_the_registry_refuses_an_identity_it_cannot_use_and_checks_replies_against_it():
    grid = SiteGrid({11: 0, 12: 7, 13: 1, 14: "edge"})  # node 12 claims a site the run does not have
    strategy = FedMVPStrategy(StrategyOptions(client_config={}, seed=1, total_rounds=3, base_lr=0.1, num_clients=2, run_id=RUN,
                              declared_examples={0: 10, 1: 10}, lora_clients=[0, 1],
                              policy=RoundPolicy(server=ServerSpec(min_nodes=1))))
    messages = strategy.configure_train(1, ArrayRecord({}), ConfigRecord(), grid)
    assert sorted(m.metadata.dst_node_id for m in messages) == [11, 13, 14]
    assert strategy.registry.roles == {11: 0, 13: 1, 14: "edge"} and "site 7" in strategy.registry.refused[12]
    strategy.global_state = {"lora.a": np.zeros(3, np.float32)}
    impostor = reply(1, {"lora.a": np.ones(3, np.float32)}, 5, lora=True)
    impostor.metadata._src_node_id = 11  # node 11 said it serves site 0
    arrays, _ = strategy.aggregate_train(1, [reply(1, {"lora.a": np.ones(3, np.float32)}, 5, lora=True), impostor])
    assert [r["reason"] for r in strategy.rejected] == ["identified itself as 0, replies as 1"]


def test_too_few_connected_nodes_fail_with_a_clear_message():
    """The failure names each node whose identity was refused, and those that never said who they are."""
    class Silent(SiteGrid):  # node 23 is connected but never answers (a round_timeout far too short, say)
        def send_and_receive(self, messages, timeout=None):
            return [r for r in super().send_and_receive(messages, timeout) if r.metadata.src_node_id != 23]

    strategy = FedMVPStrategy(StrategyOptions(client_config={}, seed=1, total_rounds=3, base_lr=0.1, num_clients=4, run_id=RUN,
                              policy=RoundPolicy(server=ServerSpec(min_nodes=3, node_wait=0.01, round_timeout=0.05))))
    with pytest.raises(RoundFailed, match="only 1 of the 3 nodes a round needs connected") as failed:
        strategy.configure_train(1, ArrayRecord(), ConfigRecord(), Silent({21: 2, 22: 7, 23: 1}))
    assert str(failed.value).splitlines()[1:] == [
        "  node 22 is sent no work: its identity names site 7, not one of the run's 4",
        "  1 connected node(s) did not say who they are within round_timeout 0.05 s (nodes 23)"]


def test_bad_replies_are_left_out_and_recorded_and_the_round_goes_on():
    strategy = FedMVPStrategy(StrategyOptions(client_config={}, seed=0, total_rounds=2, base_lr=0.1, num_clients=4, run_id=RUN,
                              declared_examples={0: 10, 1: 10, 2: 10, 3: 10}, lora_clients=range(4),
                              policy=RoundPolicy(server=ServerSpec(min_nodes=1))))
    strategy.global_state = {"lora.a": np.zeros(3, np.float32)}
    good = {"lora.a": np.ones(3, np.float32)}
    replies = [reply(0, good, 5, lora=True), reply(1, {"lora.a": np.array([np.nan, 0, 0], np.float32)}, 5, True),
               reply(2, good, 5, lora=True, round_number=7), reply(3, good, 5, lora=True, run_id="other")]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert np.array_equal(arrays["lora.a"].numpy(), np.ones(3, np.float32)) and metrics["clients"] == 1
    reasons = {r["site"]: r["reason"] for r in strategy.rejected}
    assert set(reasons) == {1, 2, 3}
    assert "NaN" in reasons[1] and "round 7" in reasons[2] and "another run" in reasons[3]
    strategy.policy = RoundPolicy(server=ServerSpec(min_nodes=2))
    assert strategy.aggregate_train(1, replies) == (None, None)  # one usable reply, two needed: try again


def test_cosine_schedule_and_harmonic_mean():
    assert cosine_lr(0.003, 1, 10) == pytest.approx(0.003)
    assert cosine_lr(0.003, 10, 10) < 0.0001
    assert harmonic_mean([0.8, 0.7, 0.6]) == pytest.approx(3 / (1 / 0.8 + 1 / 0.7 + 1 / 0.6))


# ---- edge devices ----------------------------------------------------------------------------------
def edge_reply(node: int, arrays: dict[str, np.ndarray], n: int, digest: str = "d1", round_number: int = 1,
               bundle: str = "b", run_id: str = RUN) -> Message:
    metrics = {"num-examples": n, "train-loss": 0.5}
    identity = {"role": "edge", "round": round_number, "run-id": run_id, "bundle-id": f"{bundle}{node}",
                "promptformer-digest": digest, "refreshed": 0, "refresh-bytes": 0}
    message = Message(content=records_content({**state_records(arrays), "metrics": metrics, "identity": identity}),
                      dst_node_id=1, message_type="train")
    message.metadata._src_node_id = node
    return message


def test_edge_replies_average_with_sites_in_lora_mode_and_are_recorded_per_node():
    from fedmvp.federated.wire import promptformer_digest

    strategy = FedMVPStrategy(StrategyOptions(client_config={}, seed=0, total_rounds=3, base_lr=0.1, num_clients=2, run_id=RUN,
                              declared_examples={0: 50, 1: 50}, lora_clients=[1],
                              policy=RoundPolicy(1.0, ServerSpec(min_nodes=1, edge_max_examples=40))))
    strategy.global_state = {"promptformer.w": np.zeros(2, np.float32), "lora.a": np.zeros(3, np.float32)}
    rng = np.random.default_rng(3)
    site0 = {"promptformer.w": rng.normal(size=2).astype(np.float32)}  # the PromptFormer: no LoRA
    site1 = {"lora.a": rng.normal(size=3).astype(np.float32)}  # a site after its switch
    edge7, edge9 = ({"lora.a": rng.normal(size=3).astype(np.float32)} for _ in range(2))
    replies = [edge_reply(9, edge9, 30), reply(0, site0, 10, lora=False), edge_reply(7, edge7, 20),
               reply(1, site1, 10, lora=True),
               edge_reply(8, edge7, 41),  # more images than [server] edge_max_examples
               edge_reply(6, {**edge7, "promptformer.w": np.ones(2, np.float32)}, 5)]  # an edge sends LoRA only
    arrays, metrics = strategy.aggregate_train(1, replies)
    got = {k: v.numpy() for k, v in arrays.items()}
    lora = (10 * site1["lora.a"].astype(np.float64) + 20 * edge7["lora.a"].astype(np.float64)
            + 30 * edge9["lora.a"].astype(np.float64)) / 60
    assert np.array_equal(got["lora.a"], lora.astype(np.float32))
    assert np.array_equal(got["promptformer.w"], site0["promptformer.w"])
    assert metrics["clients"] == 4 and metrics["edges"] == 2
    reasons = {r["node"]: r["reason"] for r in strategy.rejected}
    assert "edge_max_examples 40" in reasons[8] and "unexpected promptformer.w" in reasons[6]
    # The next round: the devices that hold the global PromptFormer get the LoRA only; the others all.
    strategy.known[7]["promptformer-digest"] = promptformer_digest(strategy.global_state)

    grid = SiteGrid({7: "edge", 9: "edge", 100: 0, 101: 1})
    messages = {m.metadata.dst_node_id: m for m in strategy.configure_train(2, arrays, ConfigRecord(), grid)}
    assert set(content_state(messages[7].content)) == {"lora.a"}
    assert set(content_state(messages[9].content)) == set(content_state(messages[100].content)) == {"lora.a", "promptformer.w"}
    assert content_records(messages[7].content)["config"]["promptformer-digest"] == promptformer_digest(strategy.global_state)


def test_edge_replies_record_what_the_round_state_lists():
    strategy = FedMVPStrategy(StrategyOptions(client_config={}, seed=0, total_rounds=3, base_lr=0.1, num_clients=1, run_id=RUN,
                              policy=RoundPolicy(server=ServerSpec(min_nodes=1))))
    strategy.global_state = {"lora.a": np.zeros(3, np.float32)}
    strategy.aggregate_train(1, [edge_reply(5, {"lora.a": np.ones(3, np.float32)}, 12)])
    summary = strategy.written.to_json()  # the round's state.json, before it is saved
    assert summary["replies"] == [{"node": 5, "role": "edge", "examples": 12, "loss": 0.5, "bundle_id": "b5",
                                   "refreshed": False, "refresh_bytes": 0, "staleness": 0, "s": 1.0, "weight": 1.0}]
    assert summary["sites"] == [] and summary["metrics"]["edges"] == 1


@pytest.mark.parametrize("what", ["loss", "tensor"])
def test_a_non_finite_round_stops_the_run_naming_the_round(monkeypatch, what):
    """Never publish or train on a NaN global state; the run stops with one line naming the round."""
    import fedmvp.federated.strategy as strategy_module

    strategy = FedMVPStrategy(StrategyOptions(client_config={"preset": "p.toml"}, seed=0, total_rounds=4, base_lr=0.003,
                              num_clients=1, run_id=RUN, round_offset=4))
    strategy.global_state = {"promptformer.w": np.zeros(2, np.float32)}
    if what == "loss":
        monkeypatch.setattr(strategy_module, "loss_summary", lambda metrics: {
            "train-loss": float("nan"), "train-ce": 0.0, "train-consistency": 0.0})
    else:
        from fedmvp.federated.aggregate import Aggregate
        from fedmvp.federated.update_rules import UPDATE_RULES

        monkeypatch.setitem(UPDATE_RULES, "fedavg", lambda theta, updates, **_: Aggregate(
            {"promptformer.w": np.full(2, np.inf, np.float32)}, [{}] * len(updates)))
    with pytest.raises(RoundFailed, match="round 5: the (training loss|averaged tensor promptformer.w)"):
        strategy.aggregate_train(1, [reply(0, {"promptformer.w": np.ones(2, np.float32)}, 10, lora=False,
                                           round_number=5)])
    assert strategy.written is None  # nothing to save
