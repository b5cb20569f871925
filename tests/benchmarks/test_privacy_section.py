"""`python -m benchmarks privacy --quick` for real (issue 26 §4): a one-round run of the demo's smallest
federation is trained, its edge task runs without privacy and at three noise levels, and the record
holds the keys, epsilon is dp-accounting's own for (z, rounds, delta), and privacy.png is written.
Accuracy figures are not checked (one noise draw, a tiny run); structure and provenance are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests.benchmarks.conftest import section_env
from tests.deadlines import scaled

pytestmark = pytest.mark.deployment  # a benchmark section and a Ray simulation (see pyproject.toml markers)



@pytest.fixture(scope="module")
def quick(tmp_path_factory, quick_trained_run) -> tuple[dict, Path]:
    """The section's CLI on the session's quick run (what --quick would train for itself)."""
    out = tmp_path_factory.mktemp("privacy-out")
    done = subprocess.run([sys.executable, "-m", "benchmarks", "privacy", "--quick", "--run", str(quick_trained_run),
                           "--json", "--out", str(out)], cwd=out, env=section_env(), capture_output=True, text=True,
                          timeout=scaled(900))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), out


@pytest.mark.timeout(900)
def test_quick_section_writes_the_keys_and_the_plot(quick, quick_trained_run) -> None:
    from benchmarks import privacy, suite

    record, out = quick
    assert suite.SECTIONS["privacy"] == "benchmarks.privacy"
    plan = privacy.PLANS["quick"]
    ratios, config = record["ratios"], record["config"]
    assert 0.0 <= ratios["edge_acc_nonprivate"] <= 1.0
    assert isinstance(ratios["privacy_accuracy_drop_points_at_eps_le_8"], float)
    points = config["edge_acc_at_eps"]
    assert sorted(p["noise_multiplier"] for p in points) == sorted(plan.noise)  # three noise levels
    assert all(0.0 <= p["edge_acc"] <= 1.0 and len(p["by_round"]) == plan.rounds for p in points)
    assert [r["mode"] for r in record["rows"]] == ["none"] + ["central"] * len(plan.noise)
    assert (out / "privacy.png").stat().st_size > 0  # in --out, and (given --run) beside the run
    assert config["plots"] == [str(out / "privacy.png"), str(quick_trained_run / "privacy.png")]
    assert record["goals"][0]["target"] == "<= 3 pts"


@pytest.mark.timeout(900)
def test_quick_section_epsilon_is_dp_accountings(quick) -> None:
    """Each setting's epsilon is what the run recorded, and that equals dp-accounting's RDP accountant for
    `rounds` Gaussian mechanisms of multiplier z at q = 1 (an ingest samples no one), delta 1e-5."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    from benchmarks import privacy

    record, _ = quick
    plan = privacy.PLANS["quick"]
    for point in record["config"]["edge_acc_at_eps"]:
        for number, by_round in enumerate(point["by_round"], start=1):
            accountant = RdpAccountant()
            accountant.compose(dp_accounting.SelfComposedDpEvent(
                dp_accounting.GaussianDpEvent(point["noise_multiplier"]), number))
            assert by_round["dp_rounds"] == number
            assert by_round["epsilon"] == pytest.approx(accountant.get_epsilon(privacy.DELTA), rel=1e-9)
        assert point["epsilon"] == point["by_round"][-1]["epsilon"]
    epsilons = [p["epsilon"] for p in sorted(record["config"]["edge_acc_at_eps"], key=lambda p: p["noise_multiplier"])]
    assert epsilons == sorted(epsilons, reverse=True) and len(plan.noise) == 3  # more noise, less epsilon
