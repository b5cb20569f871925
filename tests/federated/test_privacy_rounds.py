"""Epsilon recomputed from who was in each release (docs/howto/privacy.md, "Accounting").

Rounds and buffered versions run through the real strategy and its round writer into a run directory; each
test then reads every round's state.json (the nodes its LoRA release holds, ``replies``), composes the
mechanism each device actually went through with dp-accounting itself, and compares that with the
epsilon the run recorded: one device at fraction 0.1 trains every round, so each round is a Gaussian
with q = 1 and max_epsilon 8 stops it; a fast device in a buffered run is in a version at most once;
a round that added no noise is charged nothing (and `fedmvp train` says so); devices are drawn from OS
entropy, not the seed; a buffered private run short of devices stops in one line.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message

from fedmvp.federated.buffered import BufferedStrategy
from fedmvp.federated.round_writer import RoundWriter
from fedmvp.federated.strategy import FedMVPStrategy, RoundFailed, RoundPolicy, StrategyOptions
from fedmvp.federated.wire import array_record, content_records
from fedmvp.presets.server import ServerSpec
from fedmvp.runs import RunDir
from fedmvp_formats.privacy import PrivacyRecord
from tests.federated.test_aggregation import RUN, SiteGrid, _flower_run_identity, edge_reply, reply  # noqa: F401

Z, DELTA = 1.0, 1e-5
THETA = {"lora.a": np.zeros(6, np.float32), "promptformer.w": np.zeros(2, np.float32)}


def dp_epsilon(rates: list[float], z: float = Z, delta: float = DELTA) -> float:
    """dp-accounting's epsilon of one participant through these mechanisms (q = 1: a Gaussian)."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    accountant = RdpAccountant()
    for q in rates:
        gaussian = dp_accounting.GaussianDpEvent(z)
        accountant.compose(gaussian if q == 1.0 else dp_accounting.PoissonSampledDpEvent(q, gaussian))
    return float(accountant.get_epsilon(delta))


def states(run: Path) -> list[dict]:
    return [json.loads((RunDir(run).round_path(n) / "state.json").read_text()) for n in RunDir(run).rounds()]


def edges_in(state: dict) -> list[int]:
    """The edge devices whose update a round recorded (its replies), one entry per update, by node."""
    return sorted(r["node"] for r in state["replies"] if r.get("role") == "edge")


def strategy_for(fraction: float, privacy: PrivacyRecord, total: int = 20, run: Path | None = None,
                 mode: type = FedMVPStrategy, **server) -> FedMVPStrategy:
    """The real strategy (``mode``: a server mode's class); ``run``: its rounds written there by the
    server's own ``RoundWriter`` (state.json per round), the run directory holding the [privacy] record."""
    options = StrategyOptions(client_config={}, seed=0, total_rounds=total, base_lr=0.1, num_clients=1, run_id=RUN,
                              policy=RoundPolicy(fraction, ServerSpec(**{"min_nodes": 1, "node_wait": 5, **server})),
                              privacy=privacy)
    writer = None
    if run is not None:
        RunDir(run).write_config({"privacy": privacy.record(), "rounds": total})
        writer = RoundWriter(RunDir(run), options.policy.server, privacy)
    made = mode(options, writer) if mode is FedMVPStrategy else mode(options, writer, sleep=lambda s: time.sleep(0.002))
    made.evaluate_round = lambda grid, state, number: {}  # a due round's evaluation is not what is tested here
    return made


def sync_round(strategy: FedMVPStrategy, grid: SiteGrid, number: int) -> list[int]:
    """One round: every node sent work replies (site 0 with the PromptFormer, devices with the LoRA)."""
    messages = strategy.configure_train(number, array_record(strategy.global_state or THETA), ConfigRecord(), grid)
    rng = np.random.default_rng(number)
    replies = []
    for message in messages:
        node = message.metadata.dst_node_id
        if grid.roles[node] == "edge":
            replies.append(edge_reply(node, {"lora.a": rng.normal(size=6).astype(np.float32)}, 10,
                                      round_number=number))
        else:
            replies.append(reply(0, {"promptformer.w": rng.normal(size=2).astype(np.float32)}, 10, lora=False,
                                 round_number=number))
    strategy.aggregate_train(number, replies)
    if strategy.written is not None:  # what the server's start does next: evaluate when due, save
        strategy.close_round(grid, strategy.written, strategy.global_state)
    return sorted(m.metadata.dst_node_id for m in messages if grid.roles[m.metadata.dst_node_id] == "edge")


def test_one_device_at_fraction_0_1_is_charged_q_1_each_round_and_max_epsilon_stops_it(tmp_path):
    """The defect: one connected device and fraction 0.1 trained every round, charged q = 0.1 (epsilon
    4.2 recorded after 20 rounds, about 30 spent); max_epsilon 8 never stopped it."""
    strategy = strategy_for(0.1, PrivacyRecord(noise_multiplier=Z, max_epsilon=8.0), run=tmp_path)
    grid = SiteGrid({7: "edge", 100: 0})
    with pytest.raises(RoundFailed, match=r"privacy budget: round \d+ would take epsilon to .* max_epsilon 8"):
        for number in range(1, 21):
            sync_round(strategy, grid, number)
    recorded = states(tmp_path)
    assert 1 <= len(recorded) < 20  # the budget stopped the run
    rounds_in = [n for n, state in enumerate(recorded, 1) if 7 in edges_in(state)]
    assert rounds_in == list(range(1, len(recorded) + 1))  # the lone device was in every release
    spent = dp_epsilon([1.0] * len(rounds_in))  # with certainty each time: a Gaussian per round
    assert recorded[-1]["privacy"]["epsilon"] == pytest.approx(spent, rel=1e-12)
    assert spent <= 8.0 < dp_epsilon([1.0] * (len(rounds_in) + 1))
    assert all(state["privacy"]["contributors"] == [7] for state in recorded)


def test_a_large_population_is_drawn_by_poisson_sampling_from_os_entropy_and_charged_its_rate(tmp_path):
    strategy = strategy_for(0.25, PrivacyRecord(noise_multiplier=Z, max_epsilon=None), run=tmp_path)
    grid = SiteGrid({**{node: "edge" for node in range(1, 41)}, 100: 0})
    drawn = [sync_round(strategy, grid, number) for number in range(1, 5)]
    # the draw is not the seed's: the same seed and rounds, drawn again, differ (P(equal) < 1e-6)
    again = strategy_for(0.25, PrivacyRecord(noise_multiplier=Z, max_epsilon=None))
    assert [sync_round(again, grid, number) for number in range(1, 5)] != drawn
    recorded = states(tmp_path)
    for state, sent in zip(recorded, drawn):
        assert edges_in(state) == state["privacy"]["contributors"] == sent
        assert (state["privacy"]["sampling"], state["privacy"]["population"]) == ("poisson", 40)
    # a device in every round is charged the Poisson-subsampled Gaussian at q = 0.25 per round
    assert recorded[-1]["privacy"]["epsilon"] == pytest.approx(dp_epsilon([0.25] * 4), rel=1e-12)


def test_poisson_edges_includes_each_device_independently_at_the_rate():
    from fedmvp.federated.sampling import poisson_edges, poisson_fits

    draws = [poisson_edges(0.2, range(50)) for _ in range(400)]
    counts = np.array([len(d) for d in draws])
    share = np.array([sum(node in d for d in draws) for node in range(50)]) / len(draws)
    assert abs(share.mean() - 0.2) < 0.01 and share.min() > 0.1 and share.max() < 0.3
    assert counts.std() > 1.5  # not a fixed number: binomial(50, 0.2) has std 2.8
    assert not poisson_fits(0.1, 1) and not poisson_fits(0.1, 49) and poisson_fits(0.1, 50)
    assert not poisson_fits(1.0, 1000)


def test_a_round_that_added_no_noise_is_charged_nothing_and_says_it_is_not_private(tmp_path, caplog):
    from fedmvp.federated.evaluation import format_table
    from fedmvp.federated.privacy_budget import round_privacy

    strategy = strategy_for(1.0, PrivacyRecord(noise_multiplier=Z, max_epsilon=None), 2, run=tmp_path)
    grid = SiteGrid({100: 0})  # the site trains the PromptFormer: no LoRA, no noise
    sync_round(strategy, grid, 1)
    state = states(tmp_path)[0]
    assert "privacy" not in state and "epsilon" not in state["metrics"] and strategy.privacy_events == []
    assert "site 0 trained the PromptFormer" in state["not_private"] and "no epsilon charged" in state["not_private"]
    assert "round 1: not differentially private" in caplog.text
    report = round_privacy(RunDir(tmp_path), 1)
    assert report["epsilon"] is None and report["not_private_rounds"] == 1
    table = format_table({"run": "r", "round": 1, "zero-shot": {}, "tuned": {}, "privacy": report})
    assert "not differentially private" in table and "epsilon" not in table
    # a device's LoRA in the next round is noised and charged; the site's PromptFormer still is not private
    sync_round(strategy, SiteGrid({7: "edge", 100: 0}), 2)
    second = states(tmp_path)[1]
    assert second["privacy"]["epsilon"] == pytest.approx(dp_epsilon([1.0]), rel=1e-12)
    assert second["privacy"]["dp_rounds"] == 1 and "not differentially private" in second["not_private"]


# ---- buffered versions: one update per device per version --------------------------------------------------
class BufferedGrid(SiteGrid):
    """Edge devices that reply to a train message after ``delay[node]`` pulls (0: at once, a fast device)."""

    def __init__(self, delay: dict[int, int]):
        super().__init__({node: "edge" for node in delay})
        self.delay, self.out, self.pulls, self.sent = delay, {}, {}, 0

    def push_messages(self, messages):
        messages = list(messages)
        if messages and messages[0].metadata.message_type == "query.identify":
            return super().push_messages(messages)
        ids = []
        for message in messages:
            self.sent += 1
            message.metadata.__dict__["_message_id"] = f"train-{self.sent}"
            self.out[f"train-{self.sent}"], self.pulls[f"train-{self.sent}"] = message, 0
            ids.append(f"train-{self.sent}")
        return ids

    def pull_messages(self, ids):
        ids = list(ids)
        if any(i.startswith("query") for i in ids):
            return super().pull_messages(ids)
        replies = []
        for message_id in ids:
            message = self.out.get(message_id)
            if message is None:
                continue
            self.pulls[message_id] += 1
            node = message.metadata.dst_node_id
            if self.pulls[message_id] > self.delay[node]:
                del self.out[message_id]
                config = content_records(message.content)["config"]
                lora = {"lora.a": np.random.default_rng(self.sent).normal(size=6).astype(np.float32)}
                sent = edge_reply(node, lora, 10, digest=config["promptformer-digest"], round_number=config["round"])
                answer = Message(content=sent.content, reply_to=message)
                answer.metadata._src_node_id = node
                replies.append(answer)
        return replies


def test_a_fast_device_is_in_a_buffered_version_at_most_once_and_epsilon_follows(tmp_path):
    """The defect: one fast device filled the whole buffer, noise z C / m against a sensitivity of C."""
    strategy = strategy_for(1.0, PrivacyRecord(noise_multiplier=Z, clip_norm=0.1, max_epsilon=None), total=3,
                            run=tmp_path, mode=BufferedStrategy, concurrency=3, buffer_size=3, max_staleness=20)
    grid = BufferedGrid({7: 0, 8: 6, 9: 6})  # 7 replies at once, 8 and 9 after six pulls
    strategy.start(grid, array_record(THETA), num_rounds=3)
    recorded = states(tmp_path)
    assert len(recorded) == 3
    for state in recorded:
        nodes = edges_in(state)
        assert len(nodes) == len(set(nodes)) == 3  # one update per device per version
        assert state["privacy"]["contributors"] == sorted(nodes)
        assert state["privacy"]["noise_std"] == pytest.approx(Z * 0.1 / len(set(nodes)))
    # every device in every version, with certainty: a Gaussian per version
    assert recorded[-1]["privacy"]["epsilon"] == pytest.approx(dp_epsilon([1.0] * 3), rel=1e-12)


@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
@pytest.mark.timeout(600)
def test_fedmvp_train_says_which_rounds_are_not_private_and_charges_only_the_noised_ones(tmp_path, small_world):
    """At the real command: round 1's sites train the PromptFormer (no noise: not private, no epsilon),
    round 2's their LoRA (noised; sites are a fixed, seeded draw, so q = 1)."""
    from tests.federated.conftest import PRESET
    from tests.hostile.disk import run

    preset = tmp_path / "private.toml"
    preset.write_text(PRESET.format(root=small_world, sigma=1000.0).replace("rounds = 3", "rounds = 2")
                      + "\n[privacy]\nnoise_multiplier = 1.0\n")
    done = run("fedmvp", ["train", "--config", str(preset), "--run-dir", str(tmp_path / "run")], cwd=tmp_path,
               timeout=540, in_process=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "round 1: not differentially private: sites 0, 1 trained the PromptFormer" in output
    first, second = states(tmp_path / "run")
    assert "privacy" not in first and "epsilon" not in first["metrics"] and "not_private" in first
    assert second["privacy"]["contributor_sites"] == [0, 1] and second["privacy"]["sampling_rate"] == 1.0
    assert second["privacy"]["epsilon"] == pytest.approx(dp_epsilon([1.0]), rel=1e-12)
    assert "1 rounds not private" in output and f"privacy: epsilon {dp_epsilon([1.0]):.3g}" in output


def test_a_buffered_private_run_with_fewer_devices_than_buffer_size_stops_in_one_line(tmp_path):
    strategy = strategy_for(1.0, PrivacyRecord(noise_multiplier=Z, max_epsilon=None), total=2, run=tmp_path,
                            mode=BufferedStrategy, concurrency=2, buffer_size=2, node_wait=0.5)
    with pytest.raises(RoundFailed, match=r"version 1: only 1 different devices sent an update within node_wait "
                                          r"0.5 s; under \[privacy\] a version takes one update per device"):
        strategy.start(BufferedGrid({7: 0}), array_record(THETA), num_rounds=2)
    assert states(tmp_path) == []  # the lone device never made a version by itself
