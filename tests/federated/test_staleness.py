"""Deltas weighted by staleness (docs/method.md §6): theta + eta * sum n s(t) delta / sum n.

Every check is on the weights a round writes: fresh updates give today's FedAvg bit for bit; a stale
update moves theta by s(t) times what the same delta would move it fresh; each [server] key
(staleness_exponent, server_lr) changes the written tensors; the round's state records t, s(t), weight.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedmvp.federated.aggregate import Update, apply_updates, staleness_weight, weighted_average
from fedmvp.federated.ingest import ingest
from fedmvp.federated.strategy import FedMVPStrategy, RoundPolicy, StrategyOptions
from fedmvp.presets.server import ServerSpec
from fedmvp.runs import RunDir
from tests.federated.test_aggregation import RUN, _flower_run_identity, edge_reply  # noqa: F401 (fixture)
from tests.federated.test_ingest import SERVER, base_run, configure, lora_of, run  # noqa: F401 (fixtures)


def _states(seed: int, count: int, size: int = 48) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"lora.a": rng.normal(size=size).astype(np.float32), "lora.b": rng.normal(size=(4, 3)).astype(np.float32)}
            for _ in range(count)]


def test_fresh_updates_are_exactly_todays_fedavg():
    theta = _states(0, 1)[0]
    states, examples = _states(1, 4), [3, 10, 7, 1]
    fedavg = weighted_average([(s, float(n)) for s, n in zip(states, examples)])
    step = apply_updates(theta, [Update(s, n) for s, n in zip(states, examples)])
    for name in fedavg:
        assert np.array_equal(step.tensors[name], fedavg[name])  # bit for bit
    # the delta form itself (base given explicitly: no shortcut) is the same mean up to float rounding
    explicit = apply_updates(theta, [Update(s, n, 0, theta) for s, n in zip(states, examples)])
    for name in fedavg:
        np.testing.assert_allclose(explicit.tensors[name], fedavg[name], rtol=0, atol=1e-6)
    assert [w["weight"] for w in step.weights] == pytest.approx([n / 21 for n in examples])
    assert all(w["staleness"] == 0 and w["s"] == 1.0 for w in step.weights)


@pytest.mark.parametrize("t, a", [(1, 0.5), (3, 0.5), (2, 1.0), (4, 0.0)])
def test_a_stale_delta_moves_theta_by_s_of_t_times_a_fresh_one(t, a):
    theta, base, trained = _states(2, 3)
    delta = {k: trained[k].astype(np.float64) - base[k] for k in trained}
    stale = apply_updates(theta, [Update(trained, 5, t, base)], exponent=a).tensors
    fresh = apply_updates(theta, [Update({k: theta[k] + delta[k] for k in theta}, 5)], exponent=a).tensors
    s = (1 + t) ** -a
    assert staleness_weight(t, a) == pytest.approx(s)
    for k in theta:
        np.testing.assert_allclose(stale[k] - theta[k], s * (fresh[k].astype(np.float64) - theta[k]), atol=2e-6)


def distinct_round_one(run) -> None:
    """Round 1's LoRA made unlike round 2's (the fixture trains none between them)."""
    import torch

    checkpoint = RunDir(run).load_checkpoint(1)
    tensors = {k: v + 0.3 if k.startswith("lora.") else v for k, v in checkpoint.tensors.items()}
    RunDir(run).save_checkpoint(1, tensors, {k: v for k, v in checkpoint.state.items() if k != "complete"})
    assert all(not torch.equal(tensors[k], RunDir(run).load_checkpoint(2).tensors[k]) for k in tensors
               if k.startswith("lora."))


def test_ingest_applies_a_stale_file_as_a_discounted_delta_against_its_own_round(run, tmp_path):
    """A device that trained from round 1 carries round 1's LoRA plus its change: round 3 gets round 2's
    LoRA plus s(1) times that change, not round 1's values back."""
    from tests.federated.test_ingest import good_update

    configure(run, {**SERVER, "max_staleness": 3})
    distinct_round_one(run)
    lora1, lora2 = lora_of(run, 1), lora_of(run, 2)
    old = good_update(tmp_path / "old.st", lora1, 0.01, 10, 1.0, round_number=1)
    result = ingest(run, [old])
    after = lora_of(run, 3)
    trained = {k: lora1[k] + 0.01 * (i + 1) for i, k in enumerate(sorted(lora1))}  # what good_update wrote
    for k in lora1:
        expected = lora2[k].astype(np.float64) + 2 ** -0.5 * (trained[k].astype(np.float64) - lora1[k])
        np.testing.assert_allclose(after[k], expected, atol=1e-6)
    record = RunDir(run).load_checkpoint(3).state["ingest"][0]
    assert (record["staleness"], record["s"], record["weight"]) == (1, pytest.approx(2 ** -0.5),
                                                                      pytest.approx(2 ** -0.5))
    assert result.files[0].staleness == 1


@pytest.mark.parametrize("key, value, factor", [
    ("staleness_exponent", 0.0, 1.0), ("staleness_exponent", 1.0, 0.5), ("staleness_exponent", 2.0, 0.25),
    ("server_lr", 0.5, 0.5 * 2 ** -0.5), ("server_lr", 2.0, 2.0 * 2 ** -0.5),
])
def test_each_server_key_reaches_the_ingested_weights(run, tmp_path, key, value, factor):
    from tests.federated.test_ingest import good_update

    configure(run, {**SERVER, "max_staleness": 3, key: value})
    distinct_round_one(run)
    lora1, lora2 = lora_of(run, 1), lora_of(run, 2)
    ingest(run, [good_update(tmp_path / "old.st", lora1, 0.01, 10, 1.0, round_number=1)])
    after = lora_of(run, 3)
    for i, k in enumerate(sorted(lora1)):
        np.testing.assert_allclose(after[k] - lora2[k], factor * 0.01 * (i + 1), atol=2e-6)
    assert RunDir(run).load_checkpoint(3).state["ingest_rules"][key] == value


@pytest.mark.parametrize("server_lr", [1.0, 0.5, 3.0])
def test_server_lr_scales_an_online_rounds_step(server_lr):
    theta = {"lora.a": np.linspace(-1, 1, 6).astype(np.float32)}
    edges = [{"lora.a": theta["lora.a"] + np.float32(d)} for d in (0.2, -0.1)]
    strategy = FedMVPStrategy(StrategyOptions(client_config={}, seed=0, total_rounds=3, base_lr=0.1, num_clients=1, run_id=RUN,
                              policy=RoundPolicy(server=ServerSpec(min_nodes=1, server_lr=server_lr))))
    strategy.global_state = dict(theta)
    arrays, _ = strategy.aggregate_train(1, [edge_reply(5, edges[0], 10), edge_reply(6, edges[1], 30)])
    summary = strategy.written.to_json()
    mean_delta = (10 * 0.2 + 30 * -0.1) / 40
    np.testing.assert_allclose(arrays["lora.a"].numpy() - theta["lora.a"], server_lr * mean_delta, atol=1e-6)
    assert [r["weight"] for r in summary["replies"]] == pytest.approx([server_lr * 0.25, server_lr * 0.75])
    assert all(r["staleness"] == 0 and r["s"] == 1.0 for r in summary["replies"])


@pytest.mark.parametrize("key, value, problem", [
    ("staleness_exponent", -0.1, "staleness_exponent must be a finite number >= 0"),
    ("server_lr", 0.0, "server_lr must be a finite number > 0"),
])
def test_the_keys_are_range_checked(key, value, problem):
    assert problem in ServerSpec(**{key: value}).problem()
