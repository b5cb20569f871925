"""`python -m benchmarks poison --quick` for real: a one-round run of the demo's smallest federation, five
devices, one of them malicious. The record holds the keys, every registered rule aggregates every
setting, the backdoor is real (the attacker's own LoRA sends triggered images to the target more than
the honest one does), and the rule the copy's server record names is the one ingest applied."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests.benchmarks.conftest import section_env
from tests.deadlines import scaled

ROBUST = ("median", "multi_krum", "norm_clip", "trimmed_mean")
KEYS = ("backdoor_success_best_rule", "clean_drop_points_best_rule", "backdoor_success_no_defence",
        "default_rule_cost_points_no_attack", "claimed_count_success_no_defence", "claimed_count_success_default_rule",
        "boosted_backdoor_success_default_rule", "replays_accepted")


@pytest.fixture(scope="module")
def quick(tmp_path_factory, quick_trained_run) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("poison-out")
    return run_quick(out, quick_trained_run), out


def run_quick(out: Path, trained: Path) -> dict:
    """The section's CLI in a process of its own, on the session's quick run (what --quick would train)."""
    done = subprocess.run([sys.executable, "-m", "benchmarks", "poison", "--quick", "--run", str(trained), "--json",
                           "--out", str(out)], cwd=out, env=section_env(), capture_output=True, text=True,
                          timeout=scaled(900))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.deployment  # the section's run and the session's quick training
@pytest.mark.timeout(900)
def test_quick_section_has_the_keys_rows_and_plot(quick, quick_trained_run) -> None:
    from benchmarks import poison, suite

    record, out = quick
    assert suite.SECTIONS["poison"] == "benchmarks.poison"
    plan = poison.PLANS["quick"]
    ratios, config = record["ratios"], record["config"]
    assert all(key in ratios for key in KEYS)
    assert 0.0 <= ratios["clean_acc_before_training"] <= 1.0
    assert config["rules"] == ["fedavg", *ROBUST]  # the registry as it is at run time, the default first
    attacks = ("backdoor", "scaling", "sign_flip", "backdoor_boosted", poison.CLAIMED)
    settings = [("none", 0)] + [(a, m) for a in attacks for m in plan.malicious]
    assert [(r["attack"], r["malicious"], r["rule"]) for r in record["rows"]] == [
        (a, f"{m} of {plan.devices}", rule) for a, m in settings
        for rule in config["rules"] + ([poison.UNCAPPED] if a == poison.CLAIMED else [])]
    assert all(r["error"] is None and 0.0 <= r["clean_acc"] <= 1.0 for r in record["rows"])
    assert config["default_device_rule"] == "norm_clip"  # devices' rounds are robust by default
    assert ratios["default_rule_cost_points_no_attack"] == pytest.approx(
        config["rule_cost_points_no_attack"]["norm_clip"])
    assert 0.0 <= ratios["backdoor_success_no_defence"] <= 1.0
    assert ratios["backdoor_success_best_rule"] <= ratios["backdoor_success_no_defence"]
    assert (out / "poison.png").stat().st_size > 0  # in --out, and (given --run) beside the run
    assert config["plots"] == [str(out / "poison.png"), str(quick_trained_run / "poison.png")]


@pytest.mark.deployment  # the section's run and the session's quick training
@pytest.mark.timeout(900)
def test_quick_backdoor_is_trained_into_the_attackers_lora(quick) -> None:
    """The attacker's own LoRA (trained on its trigger-patched folder) sends triggered held-out images of
    the other classes to the target more often than the same device's honest LoRA does."""
    attacker = quick[0]["config"]["attacker_local"]
    assert attacker["backdoor_target_rate"] > attacker["honest_target_rate"]
    assert attacker["backdoor_target_rate"] >= 0.05


@pytest.mark.deployment  # the section's run and the session's quick training
@pytest.mark.timeout(900)
def test_quick_rule_named_in_the_run_record_is_the_one_applied(quick) -> None:
    """Each run copy's [server] update_rule reaches ingest: under Multi-Krum (assumed_malicious 1) the ×20
    scaled file (the farthest delta) weighs nothing; under fedavg it weighs its examples' share."""
    results = {(r["attack"], r["rule"]): r for r in quick[0]["config"]["results"] if r["malicious"] == 1}
    scaled = [name for name in results[("scaling", "fedavg")]["weights"] if "attacker" in name]
    assert len(scaled) == 1
    assert results[("scaling", "multi_krum")]["weights"][scaled[0]] == 0.0
    assert results[("scaling", "fedavg")]["weights"][scaled[0]] > 0.0
    assert quick[0]["config"]["rule_settings"]["multi_krum"] == {"update_rule": "multi_krum", "device_rule": "multi_krum",
                                                                 "assumed_malicious": 1}


@pytest.mark.deployment  # the section's run and the session's quick training
@pytest.mark.timeout(900)
def test_quick_claimed_counts_are_capped_and_replays_refused(quick) -> None:
    """The backdoor claiming edge_max_examples takes nearly the whole round under FedAvg without the count cap,
    at most 3 medians' share with it, less again under the devices' default rule; the boosted backdoor's file,
    once taken, is refused when replayed into the next round (same bytes, new metadata, re-based)."""
    from benchmarks import poison

    record = quick[0]
    rows = {r["rule"]: r for r in record["rows"] if r["attack"] == poison.CLAIMED}
    devices = poison.PLANS["quick"].devices
    assert rows[poison.UNCAPPED]["attacker_weight"] > 0.9
    assert rows["fedavg"]["attacker_weight"] <= 1.1 * 3 / (3 + devices - 1)  # 3 medians against ~4 (counts vary by 1)
    assert rows["norm_clip"]["attacker_weight"] <= rows["fedavg"]["attacker_weight"]
    replays = record["config"]["replays"]
    assert replays["rule"] == "norm_clip" and replays["offered"] == 3 and replays["accepted"] == []
    assert record["ratios"]["replays_accepted"] == 0
    assert "duplicate" in replays["refused"]["same"]
    assert all(reason for reason in replays["refused"].values())


def test_best_rule_is_the_least_backdoor_success_and_points_are_against_fedavg() -> None:
    """``fill`` on made-up results: the keys are computed as docs/benchmarks.md says."""
    from benchmarks.common import Section
    from benchmarks.poison import PLANS, fill

    plan = PLANS["quick"]
    results = {("none", 0, "fedavg"): {"clean": 0.50, "success": 0.01},
               ("none", 0, "other"): {"clean": 0.48, "success": 0.01},
               ("backdoor", 1, "fedavg"): {"clean": 0.49, "success": 0.40},
               ("backdoor", 1, "other"): {"clean": 0.47, "success": 0.05}}
    section = Section("poison", config={"attacker_local": {"backdoor_target_rate": 0.9, "honest_target_rate": 0.0},
                                        "target_class": "t"})
    fill(section, results, ["fedavg", "other"], plan)
    r = section.ratios
    assert section.config["best_rule"] == "other"
    assert r["backdoor_success_best_rule"] == 0.05 and r["backdoor_success_no_defence"] == 0.40
    assert r["clean_drop_points_best_rule"] == pytest.approx(3.0)
    assert section.config["rule_cost_points_no_attack"] == {"fedavg": 0.0, "other": pytest.approx(2.0)}
