"""One trained run for the benchmark sections that start from one (privacy, poison): trained once per
session, as `--quick` trains it (the demo preset's smallest federation, one round), and given to each
section with `--run`, so no section test trains its own copy (docs/testing.md, Where the time goes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deadlines import scaled

REPO = Path(__file__).resolve().parents[2]


def section_env() -> dict[str, str]:
    """A benchmark section's process: this checkout importable, no Flower telemetry."""
    return {**os.environ, "FLWR_TELEMETRY_ENABLED": "0",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}


@pytest.fixture(scope="session")
def quick_trained_run(tmp_path_factory) -> Path:
    """`fedmvp train` on the preset `--quick` trains (benchmarks.flower.preset_file), its rounds
    (benchmarks.privacy.QUICK_RUN_ROUNDS): the run each section would otherwise train for itself."""
    from benchmarks.flower import preset_file
    from benchmarks.privacy import QUICK_RUN_ROUNDS

    work = tmp_path_factory.mktemp("quick-trained")
    preset = preset_file(work, quick=True)
    run = work / "trained"
    done = subprocess.run([sys.executable, "-m", "fedmvp_apps.cli", "train", "--config", str(preset), "--rounds",
                           str(QUICK_RUN_ROUNDS), "--run-dir", str(run), "--device", "cpu"], cwd=work,
                          env=section_env(), capture_output=True, text=True, timeout=scaled(600))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return run
