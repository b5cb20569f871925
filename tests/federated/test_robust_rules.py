"""The robust update rules against their formulas (docs/howto/robust.md, fedmvp/federated/robust_rules.py).

Each rule is checked against a reference written here from the documented formula, coordinate by
coordinate, on fresh and stale updates (the rules see s(t) x delta); each of its [server] keys changes
the result as the formula says; what a rule did not take whole is in ``screened``; an online round
records it per node; fedavg stays the registry's default, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedmvp.federated.aggregate import Update, apply_updates, weighted_average
from fedmvp.federated.robust_rules import krum_scores, trim_count
from fedmvp.federated.round_writer import RoundWriter, screening_line
from fedmvp.federated.strategy import FedMVPStrategy, RoundPolicy, StrategyOptions
from fedmvp.federated.update_rules import UPDATE_RULES, update_rule
from fedmvp.presets.server import ServerSpec
from tests.federated.test_aggregation import RUN, _flower_run_identity, edge_reply  # noqa: F401 (fixture)

NAMES = ("fedavg", "norm_clip", "trimmed_mean", "median", "multi_krum")  # another benchmark relies on these


def _world(seed: int = 0, honest: int = 5, attack: float = -20.0, stale: bool = False):
    """theta, and honest updates near one direction plus one attacker sending ``attack`` x an honest delta
    (a scaled sign flip); with ``stale`` every other update trained from an older base (t = 2)."""
    rng = np.random.default_rng(seed)
    theta = {"lora.a": rng.normal(size=12).astype(np.float32), "lora.b": rng.normal(size=(3, 4)).astype(np.float32)}
    old = {k: (v + rng.normal(scale=0.3, size=v.shape)).astype(np.float32) for k, v in theta.items()}
    direction = {k: rng.normal(scale=0.1, size=v.shape) for k, v in theta.items()}
    updates = []
    for i in range(honest + 1):
        base = old if stale and i % 2 else None
        start = base if base is not None else theta
        delta = {k: direction[k] + rng.normal(scale=0.02, size=d.shape) for k, d in direction.items()}
        if i == honest:
            delta = {k: attack * v for k, v in delta.items()}
        updates.append(Update({k: (start[k] + delta[k]).astype(np.float32) for k in theta}, 10 + 7 * i,
                              2 if base is not None else 0, base))
    return theta, updates


def _v(theta, updates, a):
    """The discounted deltas s(t_i) (x_i - base_i), flat, float64 (the documented input of every robust rule)."""
    keys = sorted(theta)
    out = []
    for u in updates:
        base = u.base if u.base is not None else theta
        s = (1 + u.staleness) ** -a
        out.append(np.concatenate([s * (u.arrays[k].astype(np.float64) - base[k]).reshape(-1) for k in keys]))
    return np.stack(out)


def _unflat(theta, flat, eta):
    out, at = {}, 0
    for k in sorted(theta):
        size = theta[k].size
        out[k] = (theta[k].astype(np.float64) + eta * flat[at:at + size].reshape(theta[k].shape)).astype(np.float32)
        at += size
    return out


def ref_norm_clip(theta, updates, a, eta, c):
    v, n = _v(theta, updates, a), np.array([u.examples for u in updates], float)
    norms = np.linalg.norm(v, axis=1)
    bound = c * np.median(norms)
    clipped = v * np.minimum(1.0, bound / norms)[:, None]
    return _unflat(theta, (n[:, None] * clipped).sum(0) / n.sum(), eta)


def ref_trimmed_mean(theta, updates, a, eta, fraction):
    v = np.sort(_v(theta, updates, a), axis=0)
    m = len(updates)
    k = int(np.floor(fraction * m))
    k = min(max(k, 1 if fraction > 0 and m >= 3 else 0), (m - 1) // 2)
    return _unflat(theta, v[k:m - k].mean(0), eta)


def ref_median(theta, updates, a, eta, _):
    return _unflat(theta, np.median(_v(theta, updates, a), axis=0), eta)


def ref_multi_krum(theta, updates, a, eta, f):
    v, n = _v(theta, updates, a), np.array([u.examples for u in updates], float)
    count = len(updates)
    scores = []
    for i in range(count):
        d = sorted(float(np.sum((v[i] - v[j]) ** 2)) for j in range(count) if j != i)
        scores.append(sum(d[:max(count - f - 2, 1)]))
    kept = np.argsort(scores, kind="stable")[:max(count - f, 1)]
    return _unflat(theta, (n[kept, None] * v[kept]).sum(0) / n[kept].sum(), eta)


REFERENCES = {"norm_clip": (ref_norm_clip, "robust_clip_factor", (2.0, 1.0, 0.5)),
              "trimmed_mean": (ref_trimmed_mean, "trim_fraction", (0.2, 0.4, 0.0)),
              "median": (ref_median, None, (None,)),
              "multi_krum": (ref_multi_krum, "assumed_malicious", (1, 2, 3))}


def _apply(name, theta, updates, eta=1.0, a=0.5, **keys):
    return update_rule(name)(theta, updates, server_lr=eta, exponent=a, privacy=None, server=ServerSpec(**keys))


def test_the_names_are_registered_and_fedavg_is_the_unchanged_default():
    assert set(NAMES) <= set(UPDATE_RULES) and UPDATE_RULES["fedavg"] is apply_updates
    assert ServerSpec().update_rule == "fedavg"
    with pytest.raises(ValueError, match=r"'krum' is not a known update rule \(known: fedavg, median, multi_krum, "
                                         r"norm_clip, .*trimmed_mean"):  # (a test may register a toy rule)
        update_rule("krum")


@pytest.mark.parametrize("stale", [False, True])
@pytest.mark.parametrize("eta", [1.0, 0.5])
@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_each_rule_is_its_formula(name, eta, stale):
    theta, updates = _world(1, stale=stale)
    reference, key, values = REFERENCES[name]
    for value in values:
        keys = {key: value} if key else {}
        got = _apply(name, theta, updates, eta, 0.5, **keys).tensors
        expected = reference(theta, updates, 0.5, eta, value)
        for k in theta:
            np.testing.assert_allclose(got[k], expected[k], rtol=0, atol=2e-6, err_msg=f"{name} {keys} {k}")


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_each_key_changes_the_result(name):
    """The rule's own key reaches it: each value gives another step (and staleness_exponent reaches all)."""
    theta, updates = _world(2, honest=6, stale=True)
    _, key, values = REFERENCES[name]
    results = [_apply(name, theta, updates, **({key: v} if key else {})).tensors["lora.a"] for v in values]
    results += [_apply(name, theta, updates, a=2.0, **({key: values[0]} if key else {})).tensors["lora.a"]]
    assert all(not np.array_equal(x, y) for i, x in enumerate(results) for y in results[i + 1:])


@pytest.mark.parametrize("name, action", [("norm_clip", "clipped"), ("trimmed_mean", "down-weighted"),
                                          ("median", "down-weighted"), ("multi_krum", "dropped")])
def test_the_attacker_is_screened_and_the_step_stays_with_the_honest(name, action):
    theta, updates = _world(3)
    honest = weighted_average([(u.arrays, float(u.examples)) for u in updates[:-1]])
    fedavg = apply_updates(theta, updates).tensors
    step = _apply(name, theta, updates)
    attacker = next(e for e in step.screened if e["update"] == len(updates) - 1)
    assert attacker["action"] == action and attacker["reason"]
    assert attacker["weight"] == step.weights[-1]["weight"]
    assert attacker["weight"] == min(w["weight"] for w in step.weights)  # weighed least of all
    if name == "multi_krum":
        assert [e["update"] for e in step.screened] == [len(updates) - 1] and attacker["weight"] == 0.0
        assert "Krum score" in attacker["reason"] and "x the median" in attacker["reason"]
    for k in theta:  # much nearer the honest mean than FedAvg with the attacker is
        assert np.linalg.norm(step.tensors[k] - honest[k]) < 0.2 * np.linalg.norm(fedavg[k] - honest[k])


def test_the_weights_are_the_share_of_each_delta_that_reached_theta():
    theta, updates = _world(4, stale=True)
    for name in ("norm_clip", "multi_krum", "trimmed_mean", "median"):
        step = _apply(name, theta, updates, eta=0.7, a=1.0)
        assert [w["s"] for w in step.weights] == pytest.approx([(1 + u.staleness) ** -1.0 for u in updates])
        assert all(0.0 <= w["weight"] <= 0.7 for w in step.weights)
    median = _apply("median", theta, updates, eta=0.7, a=1.0)  # 6 updates: two middle ones, 1/2 each, per coordinate
    total = sum(w["weight"] / w["s"] for w in median.weights)
    assert total == pytest.approx(0.7)


@pytest.mark.parametrize("fraction, m, k", [(0.0, 10, 0), (0.1, 10, 1), (0.25, 10, 2), (0.01, 3, 1), (0.01, 2, 0),
                                            (0.49, 5, 2), (0.49, 4, 1)])
def test_trim_count(fraction, m, k):
    assert trim_count(fraction, m) == k


def test_krum_scores_sum_the_nearest_squared_distances():
    vs = [{"lora.a": np.array([x], float)} for x in (0.0, 1.0, 3.0, 10.0)]
    # n = 4, f = 1: one nearest other each
    assert krum_scores(vs, 1) == pytest.approx([1.0, 1.0, 4.0, 49.0])
    assert krum_scores(vs, 0) == pytest.approx([1 + 9, 1 + 4, 4 + 9, 49 + 81])
    assert krum_scores(vs[:1], 1) == [0.0]


def test_a_tensor_sent_by_some_updates_only_is_ruled_over_those():
    theta = {"lora.a": np.zeros(4, np.float32), "promptformer.w": np.zeros(2, np.float32)}
    ups = [Update({"lora.a": np.full(4, x, np.float32)}, 1) for x in (1.0, 2.0, 30.0)]
    ups.append(Update({"promptformer.w": np.full(2, 5.0, np.float32)}, 1))
    step = _apply("median", theta, ups)
    assert np.array_equal(step.tensors["lora.a"], np.full(4, 2.0, np.float32))
    assert np.array_equal(step.tensors["promptformer.w"], np.full(2, 5.0, np.float32))
    krum = _apply("multi_krum", theta, ups, assumed_malicious=1)  # a missing tensor counts as a zero delta
    assert [e["update"] for e in krum.screened] == [2]


def test_the_round_line_names_the_least_weighed_update():
    screened = [{"node": 7, "role": "edge", "action": "down-weighted", "reason": "r7", "weight": 0.1},
                {"node": 123, "role": "edge", "action": "dropped", "reason": "Krum score 4.2e+01", "weight": 0.0}]
    assert screening_line("round 3", "multi_krum", screened, 5) == \
        "round 3: update rule multi_krum dropped node 123 (Krum score 4.2e+01); 1 more screened (state.json 'screened')"
    assert screening_line("round 3", "median", [], 4) == "round 3: update rule median took all 4 updates whole"
    odd = [{**screened[1], "node": "u\n1.st"}]  # a file name with a newline stays one line
    assert screening_line("round 3", "multi_krum", odd, 5).count("\n") == 0


def test_an_online_round_records_the_screened_node(caplog):
    """A synchronous round through the strategy: state.json's round record names the dropped node."""
    import logging

    theta = {"lora.a": np.linspace(-1, 1, 6).astype(np.float32)}
    shifts = {5: 0.1, 6: 0.12, 7: 0.09, 8: 0.11, 9: -3.0}  # node 9 sends a large sign-flipped delta
    policy = RoundPolicy(server=ServerSpec(min_nodes=1, update_rule="multi_krum", assumed_malicious=1))
    strategy = FedMVPStrategy(StrategyOptions(client_config={}, seed=0, total_rounds=3, base_lr=0.1, num_clients=1,
                                              run_id=RUN, policy=policy))
    strategy.global_state = dict(theta)
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy.aggregate_train(1, [edge_reply(n, {"lora.a": theta["lora.a"] + np.float32(d)}, 10)
                                     for n, d in shifts.items()])
    record = strategy.written.to_json()
    assert record["screened"] == [{"node": 9, "role": "edge", "action": "dropped",
                                   "reason": record["screened"][0]["reason"], "weight": 0.0}]
    assert [r["weight"] for r in record["replies"]] == pytest.approx([0.25] * 4 + [0.0])
    lines = [r.getMessage() for r in caplog.records if "update rule" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("round 1: update rule multi_krum dropped node 9 (Krum score")


def test_fedavg_writes_no_screened_key_and_its_numbers_bit_for_bit():
    theta, updates = _world(5)
    fresh = [Update(u.arrays, u.examples) for u in updates]
    writer = RoundWriter(None, ServerSpec(device_rule="fedavg"))
    step = writer.apply("round 1", theta, fresh, [(i, "edge") for i in range(len(fresh))])
    expected = weighted_average([(u.arrays, float(u.examples)) for u in fresh])
    assert all(np.array_equal(step.tensors[k], expected[k]) for k in expected)
    assert writer.screened(step) is None and step.screened == []
    stale = apply_updates(theta, updates, server_lr=0.5)
    again = RoundWriter(None, ServerSpec(server_lr=0.5)).apply("round 1", theta, updates)
    assert all(np.array_equal(stale.tensors[k], again.tensors[k]) for k in theta)


def test_a_buffered_version_records_the_screened_device():
    """mode = 'buffered': the version's record names the device whose (stale) delta the rule dropped."""
    from fedmvp.federated.buffered import BufferedStrategy, Contribution

    lora = {"lora.a": np.linspace(-1, 1, 6).astype(np.float32)}
    shifts = {5: 0.1, 6: 0.12, 7: 0.09, 8: 0.11, 9: -3.0}
    server = ServerSpec(min_nodes=1, mode="buffered", buffer_size=5, update_rule="multi_krum", assumed_malicious=1)
    strategy = BufferedStrategy(StrategyOptions(client_config={}, seed=0, total_rounds=3, base_lr=0.1, num_clients=1,
                                                run_id=RUN, policy=RoundPolicy(server=server)))
    strategy.bases = {0: lora}
    strategy.buffer = [Contribution(n, 0, 1, 10, {"lora.a": lora["lora.a"] + np.float32(d)}, 0.5, f"b{n}")
                       for n, d in shifts.items()]
    written = []
    strategy.close_round = lambda grid, record, state: written.append(record)
    strategy._write(None, {**lora}, 1, server.buffer_size)  # staleness 1 each: the rule sees s(1) x delta
    (record,) = written
    assert [(e["node"], e["role"], e["action"], e["weight"]) for e in record.to_json()["screened"]] == \
        [(9, "edge", "dropped", 0.0)]


@pytest.mark.parametrize("name, mode, refused", [("median", "central", True), ("norm_clip", "central", True),
                                                 ("median", "local", False), ("fedavg", "central", False)])
def test_the_writer_refuses_a_robust_rule_with_central_privacy(name, mode, refused):
    """However the privacy settings arrive (the run's record, or set on a strategy after it was built)."""
    from fedmvp.federated.round_writer import RoundFailed
    from fedmvp_formats.privacy import PrivacyRecord

    privacy = PrivacyRecord(clip_norm=0.1, mode=mode)
    line = f"[server] update_rule = {name!r} with [privacy] mode = 'central' is refused"
    if refused:
        with pytest.raises(RoundFailed, match=line.replace("[", r"\[").replace("]", r"\]")):
            RoundWriter(None, ServerSpec(update_rule=name), privacy)
    else:
        RoundWriter(None, ServerSpec(update_rule=name), privacy)
    theta, updates = _world(6)
    writer = RoundWriter(None, ServerSpec(update_rule=name))
    writer.privacy = privacy
    if refused:
        with pytest.raises(RoundFailed, match="is refused"):
            writer.apply("round 1", theta, updates)
    else:
        writer.apply("round 1", theta, updates)
