"""The robust update rules on real update files through `fedmvp ingest` (docs/howto/robust.md).

Files written by edge_client's ``write_update`` against bundles of the run's rounds 1 (stale) and 2: each
rule's round 3 is its formula (the references of test_robust_rules.py) over the files' deltas; each key
of the rule reaches the written LoRA; state.json's round record says in ``screened`` which file the rule
did not take whole, and why; fedavg's round is apply_updates' bit for bit with no ``screened`` key; the
combinations docs/howto/robust.md refuses are one line at preset load and at ingest.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedmvp.federated.aggregate import Update, apply_updates
from fedmvp.federated.ingest import ingest
from fedmvp.runs import RunDir, RunError
from tests.deadlines import scaled
from tests.federated.test_ingest import SERVER, base_run, bundle_for, configure, lora_of, run  # noqa: F401
from tests.federated.test_robust_rules import REFERENCES
from tests.federated.test_staleness import distinct_round_one

ATTACK = -15.0  # the attacker's delta: a scaled sign flip of an honest one


def _files(run, tmp_path, seed: int = 0):
    """Five honest update files (the second trained from round 1: t = 1) and one attacker's, last; with the
    Update each becomes (its delta's base the round its bundle was exported from)."""
    from edge_client.update import write_update

    distinct_round_one(run)
    rounds = {1: lora_of(run, 1), 2: lora_of(run, 2)}
    rng = np.random.default_rng(seed)
    direction = {k: rng.normal(scale=0.01, size=v.shape) for k, v in rounds[2].items()}
    files, updates = [], []
    for i in range(6):
        bundle_round = 1 if i == 1 else 2
        base = rounds[bundle_round]
        delta = {k: d + rng.normal(scale=0.002, size=d.shape) for k, d in direction.items()}
        if i == 5:
            delta = {k: ATTACK * v for k, v in delta.items()}
        tensors = {k: (base[k] + delta[k]).astype(np.float32) for k in base}
        bundle = bundle_for(tmp_path / f"bundle-{i}", base, bundle_round)
        files.append(write_update(tmp_path / f"u{i}.st", tensors, bundle=bundle, num_examples=5 + 3 * i,
                                  mean_loss=1.0))
        updates.append(Update(tensors, 5 + 3 * i, 2 - bundle_round, None if bundle_round == 2 else base))
    return files, updates, rounds[2]


CASES = [(name, key, value) for name, (_, key, values) in sorted(REFERENCES.items()) for value in values[:2]]


@pytest.mark.parametrize("name, key, value", CASES)
def test_each_rule_writes_its_formula_and_screens_the_attacker(run, tmp_path, name, key, value):
    configure(run, {**SERVER, "max_staleness": 3, "update_rule": name, **({key: value} if key else {})})
    files, updates, theta = _files(run, tmp_path)
    result = ingest(run, files)
    assert result.round == 3 and len(result.accepted) == 6
    expected = REFERENCES[name][0](theta, updates, 0.5, 1.0, value)
    after = lora_of(run, 3)
    for k in theta:
        np.testing.assert_allclose(after[k], expected[k], rtol=0, atol=2e-6, err_msg=f"{name} {key}={value} {k}")
    state = RunDir(run).load_checkpoint(3).state
    attacker = [e for e in state["screened"] if e["node"] == str(files[5])]
    assert len(attacker) == 1 and set(attacker[0]) == {"node", "role", "action", "reason", "weight"}
    entry = next(e for e in state["ingest"] if e["file"] == str(files[5]))
    assert attacker[0]["role"] == "edge" and attacker[0]["weight"] == pytest.approx(entry["weight"])
    assert attacker[0]["action"] == {"norm_clip": "clipped", "multi_krum": "dropped"}.get(name, "down-weighted")
    assert entry["weight"] == min(e["weight"] for e in state["ingest"])
    if name == "multi_krum":  # f files dropped: the attacker first
        assert len(state["screened"]) == value and entry["weight"] == 0.0
    if name == "norm_clip":
        assert entry["clipped_from"] is not None


@pytest.mark.parametrize("name, key, values", [(n, k, v[:2]) for n, (_, k, v) in sorted(REFERENCES.items()) if k])
def test_each_key_reaches_the_ingested_round(base_run, tmp_path, name, key, values):
    import shutil

    written = []
    for value in values:
        target = tmp_path / f"run-{value}"
        shutil.copytree(base_run, target)
        configure(target, {**SERVER, "max_staleness": 3, "update_rule": name, key: value})
        files, _, _ = _files(target, tmp_path / f"files-{value}")
        ingest(target, files)
        written.append(lora_of(target, 3))
        assert RunDir(target).server().subset((key,)) == {key: value}
    assert any(not np.array_equal(written[0][k], written[1][k]) for k in written[0])


def test_fedavg_is_apply_updates_bit_for_bit_and_writes_no_screened_key(run, tmp_path):
    configure(run, {**SERVER, "max_staleness": 3, "device_rule": "fedavg"})
    files, updates, theta = _files(run, tmp_path)
    result = ingest(run, files)
    order = [files.index(next(f for f in files if str(f) == v.file)) for v in result.accepted]  # by sha256
    expected = apply_updates(theta, [updates[i] for i in order]).tensors
    after = lora_of(run, 3)
    assert all(np.array_equal(after[k], expected[k]) for k in theta)
    assert "screened" not in RunDir(run).load_checkpoint(3).state


@pytest.mark.processes
def test_the_cli_says_one_line_per_round_and_its_json_stays_clean(run, tmp_path):
    """`fedmvp ingest --json` as a real process: stdout is the JSON report, stderr the round's one line."""
    import json
    import subprocess

    from tests.federated.processes import ENV, FEDMVP

    configure(run, {**SERVER, "max_staleness": 3, "update_rule": "multi_krum", "assumed_malicious": 1})
    files, _, _ = _files(run, tmp_path)
    done = subprocess.run([*FEDMVP, "ingest", "--run", str(run), "--json", *map(str, files)], capture_output=True,
                          text=True, timeout=scaled(300), env=ENV, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["round"] == 3
    lines = [line for line in done.stderr.splitlines() if "update rule" in line]
    assert len(lines) == 1 and f"round 3: update rule multi_krum dropped node {files[5]} (Krum score" in lines[0]
    assert RunDir(run).load_checkpoint(3).state["screened"][0]["node"] == str(files[5])


@pytest.mark.parametrize("name", ["norm_clip", "trimmed_mean", "median", "multi_krum"])
def test_central_privacy_with_a_robust_rule_is_refused_at_ingest(run, tmp_path, name):
    from fedmvp_formats.privacy import PrivacyRecord

    configure(run, {**SERVER, "update_rule": name})
    config = RunDir(run).read_config()
    RunDir(run).write_config({**config, "privacy": PrivacyRecord(clip_norm=0.1, max_epsilon=None).record()})
    files, _, _ = _files(run, tmp_path)
    with pytest.raises(RunError) as err:
        ingest(run, files)
    line = str(err.value)
    assert f"[server] update_rule = {name!r} with [privacy] mode = 'central' is refused" in line and "\n" not in line
    assert RunDir(run).rounds() == [1, 2]


@pytest.mark.parametrize("server, privacy, problem", [
    ('update_rule = "median"', 'mode = "central"', "[server] update_rule = 'median' with [privacy] mode = 'central'"),
    ('update_rule = "norm_clip"', 'mode = "central"', "[server] update_rule = 'norm_clip' with [privacy] mode"),
    ('update_rule = "multi_krum"', 'mode = "central"', "[server] update_rule = 'multi_krum' with [privacy] mode"),
    ('update_rule = "trimmed_mean"', 'mode = "central"', "[server] update_rule = 'trimmed_mean' with [privacy]"),
    ("trim_fraction = 0.5", None, "[server]: trim_fraction must be in [0, 0.5), got 0.5"),
    ("robust_clip_factor = 0", None, "[server]: robust_clip_factor must be a finite number > 0, got 0"),
    ("assumed_malicious = -1", None, "[server]: assumed_malicious must be 0 or more, got -1"),
    ('update_rule = "median"', 'mode = "local"', None),
    ('update_rule = "fedavg"', 'mode = "central"', None),
    ('device_rule = "norm_clip"', 'mode = "central"', "[server] device_rule = 'norm_clip' with [privacy] mode"),
    ('device_rule = "median"', 'mode = "local"', None),
    ('max_update_rms = 0', None, "[server]: max_update_rms must be a finite number > 0, got 0"),
    ("", 'mode = "central"', None),  # the devices' default rule falls back to fedavg under central DP
])
def test_the_preset_check(preset_file, server, privacy, problem):
    from fedmvp.presets.schema import PresetError, load_preset

    text = preset_file.read_text() + f"\n[server]\n{server}\n"
    preset_file.write_text(text + (f"\n[privacy]\nclip_norm = 0.3\n{privacy}\n" if privacy else ""))
    if problem is None:
        load_preset(preset_file, check_roots=False)
        return
    with pytest.raises(PresetError) as err:
        load_preset(preset_file, check_roots=False)
    assert problem in str(err.value) and "\n" not in str(err.value)


def test_an_unknown_rule_is_one_line_before_a_run_is_written(preset_file, tmp_path):
    """The server's preset check (`fedmvp train`, `fedmvp serve`, prepare_run): in the server's process, where
    a rule registered from outside the package is known; a site's process only loads the preset."""
    preset_file.write_text(preset_file.read_text() + '\n[server]\nupdate_rule = "krum"\n')
    _refused_before_a_run(preset_file, tmp_path, "update_rule 'krum'")
    preset_file.write_text(preset_file.read_text().replace('update_rule = "krum"', 'device_rule = "krum"'))
    _refused_before_a_run(preset_file, tmp_path, "device_rule 'krum'")


def _refused_before_a_run(preset_file, tmp_path, named):
    from fedmvp.federated.prepare import check_startable, prepare_run
    from fedmvp.presets.schema import load_preset

    preset = load_preset(preset_file, check_roots=False)
    for start in (lambda: check_startable(preset, simulation=True),
                  lambda: prepare_run(str(preset_file), str(tmp_path / "r"), None, False, "cpu", with_data=False)):
        with pytest.raises(RunError) as err:
            start()
        line = str(err.value)
        known = "(known: fedavg, median, multi_krum, norm_clip, "
        assert f"[server] {named} is not a known update rule {known}" in line and "\n" not in line
    assert not (tmp_path / "r").exists()
