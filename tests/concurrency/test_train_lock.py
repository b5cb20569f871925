"""`fedmvp train` holds the run's lock while it trains: an ingest (or a second --resume) meanwhile is
refused naming it, or with --wait writes the round after the training's last; a training killed with
kill -9 leaves a lock that --resume takes over with a warning (one test: each training costs a Ray start).

Before the server took the lock, an ingest during a live training wrote round R+1 and the server's
next checkpoint replaced it: the device's update was gone. Real processes; each training is paused
(tests/concurrency/paused.py) inside the ServerApp, which Flower's simulation runs in a thread of
`fedmvp train`'s process, so the lock is shown held where the rounds are written.
"""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest

from fedmvp.runs import RunDir
from tests.concurrency.processes import finish, holder, leftovers, one_error_line, reached, run, start, stderr_line
from tests.concurrency.test_run_lock import SAVE, ingested
from tests.edge_client.edge_helpers import tree_bytes
from tests.federated.test_ingest import classes_of, good_update, lora_of, round_promptformer



@pytest.fixture(scope="module")
def preset(tmp_path_factory) -> Path:
    """The federated tests' tiny two-client preset on a small synthetic world."""
    from fedmvp.synthetic.writer import write_world
    from tests.federated.conftest import write_preset

    folder = tmp_path_factory.mktemp("train-lock")
    world = write_world(folder / "world", counts={"train": 2, "test": 2}, domains=["photo", "painting"])
    return write_preset(folder, world)


def train(preset: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["fedmvp", "train", "--config", str(preset), "--run-dir", str(run_dir), *extra]


def busy(run_dir: Path, pid: int) -> str:
    """The start of the line a refused command prints about the training holding the run."""
    return f"{run_dir / '.lock'}: run in use by pid {pid} on {socket.gethostname()} since "


@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
def test_a_live_training_holds_the_run_and_a_killed_one_is_taken_over(preset, tmp_path):
    """One training's life (two trainings: each costs a Ray start): A holds the run, an ingest and a
    second --resume are refused; A is killed with kill -9 mid-training; B (--resume) takes the lock over
    with a warning; an ingest with --wait waits for B and writes the round after B's last."""
    run_dir, gate_a, gate_b = tmp_path / "run", tmp_path / "gate-a", tmp_path / "gate-b"
    a = start(train(preset, run_dir, "--rounds", "2"), tmp_path, gate_a, f"{SAVE}@2")  # round 1 written
    pid = reached(gate_a, a)
    assert holder(run_dir)["pid"] == pid and holder(run_dir)["command"] == "fedmvp train"
    update = good_update(tmp_path / "updates" / "a.safetensors", lora_of(run_dir, 1), 0.1, 10, 1.0,
                         round_number=1, run_id=None, promptformer=round_promptformer(run_dir, 1),
                         classes=classes_of(run_dir))
    before = tree_bytes(run_dir)
    refused = run(["fedmvp", "ingest", "--run", str(run_dir), str(update)], tmp_path)
    one_error_line(refused, busy(run_dir, pid), "(fedmvp train)", "nothing was written", "--wait")
    resumed = run(train(preset, run_dir, "--resume"), tmp_path)  # a second writer of the same rounds
    one_error_line(resumed, busy(run_dir, pid), "(fedmvp train)", "nothing was written")
    assert tree_bytes(run_dir) == before and RunDir(run_dir).rounds() == [1]

    os.kill(pid, signal.SIGKILL)  # mid-training: Ray's workers are up, round 2 trained, not written
    a.communicate()
    assert holder(run_dir)["pid"] == pid  # its record outlives it, its flock does not
    b = start(train(preset, run_dir, "--resume"), tmp_path, gate_b, SAVE)  # stops before writing round 2
    pid_b = reached(gate_b, b)
    assert holder(run_dir)["pid"] == pid_b
    waiting = start(["fedmvp", "ingest", "--wait", "--run", str(run_dir), str(update)], tmp_path)
    assert f"pid {pid_b}" in stderr_line(waiting, "waiting:")
    gate_b.touch()
    resumed = finish(b)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    warning = [line for line in resumed.stderr.splitlines() if line.startswith("warning:")]
    assert any(f"{run_dir / '.lock'}: taking over the lock of pid {pid} " in line and "(fedmvp train)" in line
               and "that process is gone" in line for line in warning), resumed.stderr[-3000:]
    done = finish(waiting)
    assert done.returncode == 0 and "round 3 written" in done.stdout, done.stderr[-2000:]
    assert ingested(run_dir, 3) == (["a.safetensors"], 2)  # on the training's last round, not under it
    assert RunDir(run_dir).rounds() == [1, 2, 3] and leftovers(run_dir) == []
