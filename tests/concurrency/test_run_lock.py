"""Two `fedmvp ingest` on one run at the same time: the second is refused (exit 2, one line naming the
first, the run unchanged by it) or waits and writes round R+2 on the first one's R+1. Never a lost round.

Before the run lock both read round 2 and both wrote round 3; one of the two files' round was gone
while both commands reported "round 3 written".
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time
from pathlib import Path

import pytest

from fedmvp.run_lock import run_lock
from fedmvp.run_metrics import read_metrics
from fedmvp.runs import RunDir
from tests.concurrency.processes import finish, leftovers, one_error_line, reached, run, start, stderr_line
from tests.federated.test_ingest import classes_of, good_update, lora_of, round_promptformer

pytestmark = pytest.mark.processes  # starts real processes (see pyproject.toml markers)

SAVE = "fedmvp.runs:RunDir.save_checkpoint"  # where the first ingest stops: round 2 read, round 3 not written


@pytest.fixture(scope="module")
def updates(world) -> tuple[Path, Path]:
    """Two good update files of round 2 (different LoRA, 10 and 20 examples)."""
    lora = lora_of(world / "runs" / "moved")
    folder = world / "updates"
    trained_over = round_promptformer(world / "runs" / "moved", 2)  # what ingest checks the update against
    classes = classes_of(world / "runs" / "moved")  # the class set its labels index, as a bundle records it
    return (good_update(folder / "a.safetensors", lora, 0.1, 10, 1.0, run_id=None, promptformer=trained_over,
                        classes=classes),
            good_update(folder / "b.safetensors", lora, 0.2, 20, 2.0, run_id=None, promptformer=trained_over,
                        classes=classes))


@pytest.fixture
def run_dir(world, tmp_path) -> Path:
    shutil.copytree(world / "runs" / "moved", tmp_path / "run")
    return tmp_path / "run"


def ingested(run: Path, round_number: int) -> tuple[list[str], int]:
    """(names of the files accepted into the round, the round it was ingested onto)."""
    state = json.loads((run / f"round-{round_number:04d}" / "state.json").read_text())
    return [Path(r["file"]).name for r in state["ingest"] if r["accepted"]], state["ingested_onto"]


def test_second_ingest_is_refused_or_waits_and_builds_on_the_first(run_dir, updates, tmp_path):
    a, b = updates
    gate = tmp_path / "gate"
    first = start(["fedmvp", "ingest", "--run", str(run_dir), str(a)], tmp_path, gate, SAVE)
    pid = reached(gate, first)
    refused = run(["fedmvp", "ingest", "--run", str(run_dir), str(b)], tmp_path)
    one_error_line(refused, f"{run_dir / '.lock'}: run in use by pid {pid} on {socket.gethostname()} since ",
                   "(fedmvp ingest)", "nothing was written")
    assert RunDir(run_dir).rounds() == [1, 2]

    waiting = start(["fedmvp", "ingest", "--wait", "--run", str(run_dir), str(b)], tmp_path)
    assert f"pid {pid}" in stderr_line(waiting, "waiting:")
    gate.touch()
    assert finish(first).returncode == 0
    done = finish(waiting)
    assert done.returncode == 0 and "round 4 written" in done.stdout, done.stderr[-2000:]
    assert (ingested(run_dir, 3), ingested(run_dir, 4)) == ((["a.safetensors"], 2), (["b.safetensors"], 3))
    assert {3, 4} <= {row["round"] for row in read_metrics(RunDir(run_dir))}
    assert leftovers(run_dir) == []


def test_wait_timeout_gives_up_and_changes_nothing(run_dir, updates, tmp_path):
    with run_lock(run_dir, "pytest holding the lock"):
        began = time.monotonic()
        done = run(["fedmvp", "ingest", "--wait-timeout", "1", "--run", str(run_dir), str(updates[0])], tmp_path)
        assert time.monotonic() - began >= 1
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and lines[0].startswith("waiting:") and len(lines) == 2, done.stderr
    assert lines[1].startswith("error:") and f"pid {os.getpid()}" in lines[1] and "(pytest holding the lock)" in lines[1]
    assert RunDir(run_dir).rounds() == [1, 2] and leftovers(run_dir) == []


def test_a_killed_holder_is_taken_over_with_a_warning(run_dir, updates, tmp_path):
    a, b = updates
    gate = tmp_path / "gate"
    first = start(["fedmvp", "ingest", "--run", str(run_dir), str(a)], tmp_path, gate, SAVE)
    pid = reached(gate, first)
    os.kill(pid, signal.SIGKILL)
    first.communicate()
    assert json.loads((run_dir / ".lock").read_text())["pid"] == pid  # its record outlives it, its flock does not
    done = run(["fedmvp", "ingest", "--run", str(run_dir), str(b)], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    warning = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and f"{run_dir / '.lock'}: taking over the lock of pid {pid} " in warning[0]
    assert "that process is gone" in warning[0]
    assert RunDir(run_dir).rounds() == [1, 2, 3] and ingested(run_dir, 3) == (["b.safetensors"], 2)
    assert leftovers(run_dir) == []


def test_the_holder_re_enters_and_a_forked_child_is_another_writer(run_dir):
    """The simulated ServerApp runs in a thread of `fedmvp train`: its run_lock re-enters the lock its
    process holds, and leaves it held. A child process is refused (it neither shares nor releases it)."""
    from fedmvp.run_lock import RunBusy

    with run_lock(run_dir, "fedmvp train"):
        with run_lock(run_dir, "fedmvp ServerApp"):
            assert json.loads((run_dir / ".lock").read_text())["command"] == "fedmvp train"
        assert json.loads((run_dir / ".lock").read_text())["pid"] == os.getpid()
        child = os.fork()
        if child == 0:  # pragma: no cover - the child's verdict is its exit status
            try:
                with run_lock(run_dir, "a child"):
                    os._exit(1)
            except RunBusy:
                os._exit(0)
            finally:
                os._exit(2)  # anything else: never let the child run on as pytest
        assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
        assert json.loads((run_dir / ".lock").read_text())["pid"] == os.getpid()
    assert leftovers(run_dir) == []
