"""Per-tensor weighted FedAvg over replies with different tensor sets (LoRA-only and full clients)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedmvp.federated.evaluation import harmonic_mean
from fedmvp.federated.strategy import FedMVPStrategy, cosine_lr, weighted_average
from fedmvp.federated.wire import array_record


@pytest.fixture(autouse=True)
def _flower_run_identity():
    """Messages are built inside a Flower run; outside one, give them a run id."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id = 1
    TaskIdentity.node_id = 0
    TaskIdentity.task_id = 1
    yield


def reply(client: int, arrays: dict[str, np.ndarray], n: int, lora: bool, switch: bool = False) -> Message:
    metrics = MetricRecord({"num-examples": n, "partition-id": client, "train-loss": 0.1 * (client + 1),
                            "train-ce": 0.0, "train-consistency": 0.0, "lora-active": int(lora),
                            "switch-next": int(switch)})
    return Message(content=RecordDict({"arrays": array_record(arrays), "metrics": metrics}),
                   dst_node_id=1, message_type="train")


def test_weighted_average_is_exact_per_tensor():
    a = {"promptformer.w": np.array([1.0, 2.0], np.float32), "lora.x": np.array([10.0], np.float32)}
    b = {"lora.x": np.array([40.0], np.float32)}
    out = weighted_average([(a, 1.0), (b, 3.0)])
    assert np.array_equal(out["promptformer.w"], np.array([1.0, 2.0], np.float32))  # only a sent it
    assert np.array_equal(out["lora.x"], np.array([(10 * 1 + 40 * 3) / 4], np.float32))


def test_lora_only_and_full_clients_aggregate_in_the_same_round():
    strategy = FedMVPStrategy(client_config={"preset": "p.toml"}, seed=0, total_rounds=4, base_lr=0.003,
                              num_clients=3, fraction=1.0, lora_clients=[2])
    strategy.global_state = {"promptformer.w": np.zeros(2, np.float32), "lora.a": np.zeros(3, np.float32)}
    rng = np.random.default_rng(0)
    full0 = {"promptformer.w": rng.normal(size=2).astype(np.float32), "lora.a": np.zeros(3, np.float32)}
    full1 = {"promptformer.w": rng.normal(size=2).astype(np.float32), "lora.a": np.zeros(3, np.float32)}
    lora2 = {"lora.a": rng.normal(size=3).astype(np.float32)}
    replies = [reply(2, lora2, 30, lora=True), reply(0, full0, 10, lora=False, switch=True),
               reply(1, full1, 20, lora=False)]
    arrays, metrics = strategy.aggregate_train(1, replies)
    got = {k: v.numpy() for k, v in arrays.items()}
    expected_w = (10 * full0["promptformer.w"].astype(np.float64) + 20 * full1["promptformer.w"].astype(np.float64)) / 30
    expected_a = (30 * lora2["lora.a"].astype(np.float64)) / 60
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
        strategy = FedMVPStrategy(client_config={"preset": "p"}, seed=0, total_rounds=2, base_lr=0.1,
                                  num_clients=5, fraction=1.0)
        strategy.global_state = {"lora.a": np.zeros(64, np.float32)}
        arrays, _ = strategy.aggregate_train(1, [reply(i, states[i], 7 + i, lora=True) for i in order])
        outs.append(arrays["lora.a"].numpy())
    assert np.array_equal(outs[0], outs[1])


def test_configure_sends_flags_schedule_and_a_replayable_sample():
    class FakeGrid:
        def get_node_ids(self):
            return [11, 12, 13, 14]

    strategy = FedMVPStrategy(client_config={"preset": "p.toml"}, seed=5, total_rounds=10, base_lr=0.003,
                              num_clients=10, fraction=0.3, round_offset=4, lora_clients=[3, 1])
    assert strategy.selected_clients(7) == strategy.selected_clients(7)
    assert len(strategy.selected_clients(7)) == 3
    import flwr.serverapp.strategy.fedavg as fedavg_module

    fedavg_module.sample_nodes = lambda grid, min_available, size: (grid.get_node_ids(), grid.get_node_ids())
    messages = list(strategy.configure_train(2, ArrayRecord(), ConfigRecord(), FakeGrid()))
    config = messages[0].content["config"]
    assert config["round"] == 6
    assert config["lr"] == pytest.approx(cosine_lr(0.003, 6, 10))
    assert json.loads(config["lora-clients"]) == [1, 3]


def test_cosine_schedule_and_harmonic_mean():
    assert cosine_lr(0.003, 1, 10) == pytest.approx(0.003)
    assert cosine_lr(0.003, 10, 10) < 0.0001
    assert harmonic_mean([0.8, 0.7, 0.6]) == pytest.approx(3 / (1 / 0.8 + 1 / 0.7 + 1 / 0.6))
