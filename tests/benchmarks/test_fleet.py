"""The fleet benchmark (benchmarks/fleet.py): its preset's [server] table reaches the server's record,
its model extrapolates what it fitted, and `python -m benchmarks fleet --quick` runs a real TLS
deployment of replay devices whose updates the server accepts (docs/benchmarks.md, "Fleets")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import fleet
from benchmarks.fleet_model import extrapolate, fit
from tests.deadlines import scaled

REPO = Path(__file__).resolve().parents[2]


def test_server_table_reaches_the_preset_with_extra_keys(tmp_path: Path, monkeypatch) -> None:
    from fedmvp.presets.schema import load_preset

    server = load_preset(fleet.preset_for(tmp_path, 30), check_roots=False).server
    assert (server.concurrency, server.over_selection, server.min_buffer) == (23, 1.3, 1)  # ceil(23 x 1.3) = 30 busy
    monkeypatch.setattr(fleet, "EXTRA_SERVER_KEYS", {"max_update_norm": 7.5})
    preset = load_preset(fleet.preset_for(tmp_path, 30), check_roots=False)
    server = preset.server
    assert (server.concurrency, server.buffer_size, server.max_staleness) == (23, 6, 20)
    assert server.round_timeout == fleet.ROUND_TIMEOUT
    assert server.max_update_norm == 7.5  # passed through unchanged


def test_model_fits_and_says_what_is_extrapolated() -> None:
    rows = [{"devices": n, "superlink_cpu_s_per_min": 6.0 + 0.5 * n, "updates_per_min": 15.0 * n,
             "superlink_rss_mb": 150.0 + 2.0 * n} for n in (10, 25, 50)]
    model = fit(rows)
    assert model["cpu_per_minute"]["a"] == pytest.approx(6.0)
    assert model["cpu_per_minute"]["k_per_device"] == pytest.approx(0.5)
    row = extrapolate(model, 1000)
    assert row["measured"] is False
    assert row["superlink_cpu_s_per_min"] == pytest.approx(506.0)
    assert row["superlink_rss_mb"] == pytest.approx(2150.0)
    assert row["superlink_cpu_s_per_update"] == pytest.approx(506.0 / 15000.0)


@pytest.mark.slow  # a TLS deployment of 2 then 4 replay devices, each stage started and measured
@pytest.mark.deployment
def test_quick_fleet_runs_and_its_figures_are_sane(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "benchmarks", "fleet", "--quick", "--json", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=scaled(420))
    assert done.returncode == 0, done.stderr[-2000:]
    section = json.loads(done.stdout.strip().splitlines()[-1])
    ratios = section["ratios"]
    assert set(ratios) >= {"superlink_cpu_s_per_update_at_50", "objects_per_message", "updates_per_minute_per_core"}
    measured = [r for r in section["rows"] if r["measured"]]
    assert [r["devices"] for r in measured] == list(fleet.SIZES["quick"])
    for row in measured:
        assert row["accepted_updates"] > 0, row  # the server's own checks took the replayed updates
        assert row["left_out"] == 0 and row["timed_out"] == 0, row
        assert row["superlink_cpu_s_per_update"] > 0 and row["superlink_rss_mb"] > 0 and row["rss_mb_per_device"] > 0
        assert 0 <= row["latency_median_s"] < 60
    assert ratios["superlink_cpu_s_per_update_at_50"] > 0 and ratios["objects_per_message"] >= 1
    assert section["config"]["cpu_per_update_at_devices"] == max(fleet.SIZES["quick"])
    extrapolated = [r for r in section["rows"] if not r["measured"]]
    assert [r["devices"] for r in extrapolated] == [1000, 10000]
    assert section["config"]["model"]["cpu_per_minute"]["k_per_device"] >= 0
    assert (tmp_path / "fleet.png").stat().st_size > 0
