"""Differential privacy for device updates (docs/howto/privacy.md): each test looks at the weights.

Clipping bounds every delta (the sender's and the server's); the noise reaches the aggregate with the
variance the formula says, measured over seeds; epsilon is dp-accounting's own value for the same
(q, z, steps, delta); the [privacy] table reaches what it controls; a round past max_epsilon is refused.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedmvp.federated.aggregate import Update, apply_updates
from fedmvp.federated.ingest import ingest
from fedmvp.federated.privacy_budget import epsilon
from fedmvp.runs import RunDir, RunError
from fedmvp_formats.privacy import PrivacyError, PrivacyRecord, delta_norm, privatise
from tests.federated.test_aggregation import _flower_run_identity  # noqa: F401 (fixture)
from tests.federated.test_ingest import SERVER, base_run, configure, good_update, lora_of, run  # noqa: F401


def _lora(seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"lora.a": (scale * rng.normal(size=(8, 6))).astype(np.float32),
            "lora.b": (scale * rng.normal(size=(6, 8))).astype(np.float32)}


def _minus(a: dict, b: dict) -> dict:
    return {k: a[k].astype(np.float64) - b[k].astype(np.float64) for k in a}


@pytest.mark.parametrize("scale", [1e-3, 0.05, 1.0, 30.0])
def test_the_senders_clip_bounds_every_delta(scale):
    start, settings = _lora(0), PrivacyRecord(clip_norm=0.1, mode="central")
    trained = {k: v + _lora(1, scale)[k] for k, v in start.items()}
    sent, norm = privatise(trained, start, settings)
    delta = _minus(sent, start)
    assert norm == pytest.approx(delta_norm(_minus(trained, start)))
    assert delta_norm(delta) <= 0.1 * (1 + 1e-5)  # float32 rounding of start + delta
    if norm <= 0.1:  # a short delta is sent as it is
        np.testing.assert_allclose(sent["lora.a"], trained["lora.a"], atol=1e-7)
    else:  # a long one keeps its direction
        direction = _minus(trained, start)
        np.testing.assert_allclose(delta["lora.a"] * norm / 0.1, direction["lora.a"], rtol=1e-3, atol=1e-5)


def test_the_servers_clip_bounds_every_delta_in_the_central_aggregate():
    theta, settings = _lora(0), PrivacyRecord(clip_norm=0.2, noise_multiplier=1e-9)
    updates = [Update({k: theta[k] + _lora(10 + i, 5.0)[k] for k in theta}, 10 * (i + 1)) for i in range(4)]
    step = apply_updates(theta, updates, privacy=settings, rng=np.random.default_rng(0))
    for i in range(4):  # the same update alone: it moves theta by at most C (m = 1)
        alone = apply_updates(theta, [updates[i]], privacy=settings, rng=np.random.default_rng(0))
        assert delta_norm(_minus(alone.tensors, theta)) == pytest.approx(0.2, rel=1e-4)
        assert alone.clipped[0] > 0.2
    assert delta_norm(_minus(step.tensors, theta)) <= 0.2 * (1 + 1e-4)
    assert [w["weight"] for w in step.weights] == pytest.approx([0.25] * 4)  # equal weights, not examples
    assert step.privacy["participants"] == 4 and step.privacy["clipped"] == 4


@pytest.mark.parametrize("z, clip, m, eta, stale", [(1.0, 0.1, 4, 1.0, 0), (0.5, 0.3, 2, 0.5, 0), (2.0, 0.05, 5, 1.0, 2)])
def test_central_noise_has_the_formulas_variance_over_seeds(z, clip, m, eta, stale):
    theta = _lora(0)
    updates = [Update({k: theta[k] + _lora(20 + i, 1e-4)[k] for k in theta}, 3, stale) for i in range(m)]
    settings = PrivacyRecord(clip_norm=clip, noise_multiplier=z)
    noiseless = apply_updates(theta, updates, privacy=PrivacyRecord(clip_norm=clip, noise_multiplier=1e-12),
                              server_lr=eta, rng=np.random.default_rng(0)).tensors
    draws = np.stack([np.concatenate([(apply_updates(theta, updates, privacy=settings, server_lr=eta,
                                                      rng=np.random.default_rng(seed)).tensors[k].astype(np.float64)
                                       - noiseless[k]).ravel() for k in sorted(theta)]) for seed in range(300)])
    expected = (eta * z * clip / m) ** 2
    assert abs(draws.mean()) < 5 * np.sqrt(expected / draws.size)
    assert draws.var() == pytest.approx(expected, rel=0.05)


def test_local_noise_has_the_formulas_variance_over_seeds():
    start = _lora(0)
    trained = {k: v + _lora(5, 1e-4)[k] for k, v in start.items()}
    settings = PrivacyRecord(clip_norm=0.2, noise_multiplier=0.7, mode="local")
    clean, _ = privatise(trained, start, PrivacyRecord(clip_norm=0.2, mode="central"))
    draws = np.stack([np.concatenate([(privatise(trained, start, settings, np.random.default_rng(seed))[0][k]
                                       .astype(np.float64) - clean[k]).ravel() for k in sorted(start)])
                      for seed in range(300)])
    assert draws.var() == pytest.approx((0.7 * 0.2) ** 2, rel=0.05)


@pytest.mark.parametrize("q, z, steps, delta", [(1.0, 1.0, 1, 1e-5), (1.0, 0.8, 20, 1e-5), (0.1, 1.1, 50, 1e-6),
                                                (0.01, 0.9, 1000, 1e-5)])
def test_epsilon_is_dp_accountings_own_value(q, z, steps, delta):
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    event = dp_accounting.GaussianDpEvent(z)
    event = event if q == 1.0 else dp_accounting.PoissonSampledDpEvent(q, event)
    accountant = RdpAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    assert epsilon([(q, z)] * steps, delta) == pytest.approx(accountant.get_epsilon(delta), rel=1e-12)


def _with_privacy(run, **settings) -> PrivacyRecord:
    record = PrivacyRecord(**settings)
    config = RunDir(run).read_config()
    RunDir(run).write_config({**config, "privacy": record.record()})
    return record


def test_a_private_ingest_changes_the_lora_within_the_bound_and_reports_epsilon(run, tmp_path):
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    settings = _with_privacy(run, clip_norm=0.05, noise_multiplier=1e-6, max_epsilon=None)
    lora = lora_of(run)
    files = [good_update(tmp_path / f"u{i}.st", lora, 0.02 * (i + 1), 10 * (i + 1), 1.0) for i in range(3)]
    result = ingest(run, files)
    after = lora_of(run, 3)
    moved = delta_norm(_minus(after, lora))
    assert 0 < moved <= 0.05 * (1 + 1e-3)  # the LoRA changed, by at most C
    state = RunDir(run).load_checkpoint(3).state
    accountant = RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(settings.noise_multiplier))
    assert state["privacy"]["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    assert state["privacy"]["sampling_rate"] == 1.0 and state["privacy"]["participants"] == 3
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["epsilon"] == state["privacy"]["epsilon"]
    assert [v.weight for v in result.accepted] == pytest.approx([1 / 3] * 3)


@pytest.mark.parametrize("clip", [0.01, 0.04])
def test_clip_norm_reaches_the_written_weights(run, tmp_path, clip):
    _with_privacy(run, clip_norm=clip, noise_multiplier=1e-6, max_epsilon=None)
    lora = lora_of(run)
    ingest(run, [good_update(tmp_path / "u.st", lora, 0.05, 10, 1.0)])
    assert delta_norm(_minus(lora_of(run, 3), lora)) == pytest.approx(clip, rel=1e-3)


def test_local_mode_leaves_the_servers_rule_alone(run, tmp_path):
    """Local mode: the device noised its update; the server applies the ordinary rule (FedAvg when fresh)."""
    _with_privacy(run, mode="local", clip_norm=0.05, max_epsilon=None)
    lora = lora_of(run)
    update = good_update(tmp_path / "u.st", lora, 0.05, 10, 1.0)
    ingest(run, [update])
    from safetensors.numpy import load_file

    sent = load_file(str(update))
    for k in lora:
        assert np.array_equal(lora_of(run, 3)[k], sent[k])


def test_a_round_past_max_epsilon_is_refused_in_one_line(run, tmp_path):
    _with_privacy(run, clip_norm=0.05, noise_multiplier=0.5, max_epsilon=3.0)
    lora = lora_of(run)
    with pytest.raises(RunError) as err:
        ingest(run, [good_update(tmp_path / "u.st", lora, 0.05, 10, 1.0)])
    assert "privacy budget: round 3 would take epsilon to" in str(err.value) and "max_epsilon 3" in str(err.value)
    assert "\n" not in str(err.value) and RunDir(run).rounds() == [1, 2]


def test_the_preset_table_reaches_the_run_record(preset_file, tmp_path):
    from fedmvp.federated.prepare import prepare_run
    from fedmvp.presets.schema import PresetError, load_preset

    base = preset_file.read_text()
    preset_file.write_text(base + '\n[privacy]\nclip_norm = 0.3\nnoise_multiplier = 2\nmode = "local"\n')
    run = prepare_run(str(preset_file), str(tmp_path / "r"), None, False, "cpu", with_data=False)
    assert run.privacy() == PrivacyRecord(clip_norm=0.3, noise_multiplier=2.0, mode="local")
    preset_file.write_text(base + '\n[privacy]\nclip_norm = 0\n')
    with pytest.raises(PresetError, match=r"\[privacy\]: clip_norm must be a finite number > 0, got 0"):
        load_preset(preset_file, check_roots=False)
    preset_file.write_text(base + '\n[privacy]\nclipnorm = 1\n')
    with pytest.raises(PresetError, match=r"\[privacy\]: unknown key 'clipnorm'"):
        load_preset(preset_file, check_roots=False)
    preset_file.write_text(base)
    assert prepare_run(str(preset_file), str(tmp_path / "plain"), None, False, "cpu", with_data=False
                       ).privacy() is None


def test_a_record_out_of_range_is_refused_naming_where():
    with pytest.raises(PrivacyError, match="manifest.json: privacy mode must be 'central' or 'local'"):
        PrivacyRecord.from_record({**PrivacyRecord().record(), "mode": "both"}, "manifest.json")
    assert PrivacyRecord.from_record({k: v for k, v in PrivacyRecord().record().items() if k != "max_epsilon"},
                                     "a message").max_epsilon is None


def test_an_online_round_carries_the_settings_and_a_small_population_is_charged_q_1(_flower_run_identity):
    """Two devices at fraction 0.5 expect one participant a round: too few for Poisson sampling
    (docs/howto/privacy.md), so the round is charged q = 1, not 0.5 (tests/federated/test_privacy_rounds.py)."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant
    from flwr.app import ConfigRecord

    from fedmvp.federated.strategy import FedMVPStrategy, RoundFailed, RoundPolicy, StrategyOptions
    from fedmvp.federated.wire import array_record, content_instruction
    from fedmvp.presets.server import ServerSpec
    from tests.federated.test_aggregation import RUN, SiteGrid, edge_reply

    settings = PrivacyRecord(clip_norm=0.1, noise_multiplier=1.0, max_epsilon=None)
    strategy = FedMVPStrategy(StrategyOptions(client_config={}, seed=0, total_rounds=3, base_lr=0.1, num_clients=1, run_id=RUN,
                              policy=RoundPolicy(0.5, ServerSpec(min_nodes=1, node_wait=5)), privacy=settings))
    theta = {"lora.a": np.zeros(6, np.float32)}
    messages = strategy.configure_train(1, array_record(theta), ConfigRecord(), SiteGrid({7: "edge", 8: "edge",
                                                                                         100: 0}))
    for message in messages:  # what a sender clips and noises by: the run's record
        assert PrivacyRecord.from_record(content_instruction(message.content).privacy, "message") == settings
    arrays, _ = strategy.aggregate_train(1, [edge_reply(7, {"lora.a": np.ones(6, np.float32)}, 10)])
    summary = strategy.written.to_json()
    assert not np.array_equal(arrays["lora.a"].numpy(), theta["lora.a"])
    accountant = RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(1.0))
    assert summary["privacy"]["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    assert summary["privacy"]["noise_std"] == pytest.approx(0.1) and summary["replies"][0]["weight"] == 1.0
    assert strategy.privacy_events == [(1.0, 1.0)]
    assert (summary["privacy"]["sampling"], summary["privacy"]["population"]) == ("fixed", 2)
    assert summary["privacy"]["contributors"] == [7]

    strategy.privacy = PrivacyRecord(clip_norm=0.1, noise_multiplier=0.5, max_epsilon=1.0)
    with pytest.raises(RoundFailed, match=r"privacy budget: round 2 would take epsilon to .* past \[privacy\] "
                                          r"max_epsilon 1"):
        strategy.configure_train(2, array_record(theta), ConfigRecord(), SiteGrid({7: "edge", 100: 0}))


def test_a_sites_lora_reply_is_clipped_as_a_devices(monkeypatch):
    import torch

    from fedmvp.federated.client_app import private_lora

    received = {"lora.a": torch.zeros(4, 4), "promptformer.w": torch.ones(3)}
    state = {"lora.a": torch.full((4, 4), 0.5)}
    for mode in ("central", "local"):
        record = PrivacyRecord(clip_norm=0.2, noise_multiplier=0.01, mode=mode).record()
        sent = private_lora(state, received, record)
        norm = float(sent["lora.a"].norm())
        assert (norm == pytest.approx(0.2, rel=1e-5)) if mode == "central" else (0.1 < norm < 0.3 and norm != 0.2)


def test_evaluate_reports_the_rounds_epsilon(run, tmp_path):
    from fedmvp.federated.evaluation import format_table
    from fedmvp.federated.privacy_budget import round_privacy

    _with_privacy(run, clip_norm=0.05, noise_multiplier=1.5, max_epsilon=None)
    ingest(run, [good_update(tmp_path / "u.st", lora_of(run), 0.05, 10, 1.0)])
    report = round_privacy(RunDir(run), 3)
    assert report["epsilon"] == RunDir(run).load_checkpoint(3).state["privacy"]["epsilon"] > 0
    before = round_privacy(RunDir(run), 2)  # round 2's weights: nothing noised them, no epsilon is claimed
    assert before["epsilon"] is None and before["dp_rounds"] == 0
    table = format_table({"run": str(run), "round": 3, "zero-shot": {}, "tuned": {}, "privacy": report})
    assert f"privacy: epsilon {report['epsilon']:.3g} at delta 1e-05 over 1 rounds (central" in table
    table = format_table({"run": str(run), "round": 2, "zero-shot": {}, "tuned": {}, "privacy": before})
    assert "privacy: not differentially private: no round up to this one added noise" in table
    assert "epsilon" not in table


def test_an_ingested_round_is_charged_and_does_not_inherit_its_base_rounds_not_private_note(run, tmp_path):
    from fedmvp.federated.privacy_budget import round_privacy

    _with_privacy(run, clip_norm=0.05, noise_multiplier=1.5, max_epsilon=None)
    path = RunDir(run).round_path(2) / "state.json"  # round 2: its sites trained the PromptFormer
    path.write_text(json.dumps({**json.loads(path.read_text()), "not_private": "not differentially private: ..."}))
    ingest(run, [good_update(tmp_path / "u.st", lora_of(run), 0.05, 10, 1.0)])
    assert "not_private" not in RunDir(run).load_checkpoint(3).state  # the update files' round was noised
    report = round_privacy(RunDir(run), 3)
    assert report["dp_rounds"] == 1 and report["not_private_rounds"] == 1  # round 2's PromptFormer is in it


_LOCAL = dict(mode="local", clip_norm=0.1, noise_multiplier=1.0)


@pytest.mark.parametrize("own,sent,obeyed", [
    (None, None, None),                                                      # no DP anywhere
    (None, dict(mode="central"), "sent"),                                    # the run's settings
    (dict(mode="central"), None, None),                                      # central: the server's business
    (_LOCAL, None, "own"),                                                   # a server sending none
    (_LOCAL, dict(mode="central"), "own"),                                   # ... or central
    (_LOCAL, dict(_LOCAL, clip_norm=1.0), "own"),                            # ... or a larger clip
    (_LOCAL, dict(_LOCAL, noise_multiplier=0.5), "own"),                     # ... or less noise
    (_LOCAL, dict(_LOCAL, noise_multiplier=2.0, clip_norm=0.05), "sent"),    # stricter: taken
])
def test_a_server_cannot_lower_the_local_noise_a_devices_bundle_asks_for(own, sent, obeyed):
    from fedmvp_formats.privacy import PrivacyRecord, device_privacy

    own_r = None if own is None else PrivacyRecord(**own)
    sent_r = None if sent is None else PrivacyRecord(**sent)
    assert device_privacy(own_r, sent_r) is {"own": own_r, "sent": sent_r, None: None}[obeyed]
