"""`edge-client train` against a second train, a refresh and a rollback on one bundle: one at a time.

The second command is refused (exit 2, one line naming the first; the bundle unchanged by it) or,
with --wait, runs after the first and starts from what it left. The personalisation state verifies
afterwards and nothing temporary stays. Before the bundle lock both trains started from the same
LoRA (the first one's training was discarded), and a refresh committed under a running train.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path

from edge_client.bundle import read_bundle, sha256_file
from edge_client.bundle_lock import bundle_lock
from edge_client.lora_store import active_lora, read_state
from tests.concurrency.processes import (APPLY, finish, leftovers, one_error_line, reached, run, start, stderr_line,
                                         train, unlocked)
from tests.edge_client.edge_helpers import tree_bytes
import pytest

pytestmark = pytest.mark.processes  # starts real processes (see pyproject.toml markers)

REFRESH = """import sys
from safetensors.numpy import load_file
from edge_client.bundle import BundleError, read_bundle
from edge_client.refresh import promptformer_digest, refresh_bundle
tensors = load_file(sys.argv[2])
try:
    result = refresh_bundle(read_bundle(sys.argv[1]), tensors, digest=promptformer_digest(tensors), round_number=2)
except BundleError as err:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
print(result.new_id)
"""
HOLD = """import sys, time
from edge_client.bundle_lock import bundle_lock
with bundle_lock(sys.argv[1], command="a holder to be killed"):
    print("held", flush=True)
    time.sleep(600)
"""


def entry_verifies(bundle: Path, entry: dict) -> bool:
    path = bundle / "personalised" / entry["file"]
    return sha256_file(path) == entry["sha256"] and path.stat().st_size == entry["bytes"]


def test_second_train_is_refused_or_waits_and_starts_from_the_first(bundle, world, tmp_path):
    gate = tmp_path / "gate"
    first = start(train(bundle, world, tmp_path / "u1", "--json"), tmp_path, gate, APPLY)
    pid = reached(gate, first)
    refused = run(train(bundle, world, tmp_path / "u2"), tmp_path)
    one_error_line(refused, f"{bundle / '.lock'}: bundle in use by pid {pid} on {socket.gethostname()} since ",
                   "(edge-client train)", "--wait")
    assert not (bundle / "personalised").exists() and not (tmp_path / "u2").exists()

    waiting = start(train(bundle, world, tmp_path / "u3", "--json", "--wait"), tmp_path)
    assert f"pid {pid}" in stderr_line(waiting, "waiting:")
    gate.touch()
    results = [finish(p) for p in (first, waiting)]
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    one, three = (json.loads(r.stdout) for r in results)
    assert (one["started_from"], three["started_from"]) == ("bundle", "personalised")  # the second built on it
    state = read_state(read_bundle(bundle))
    assert [e["update"]["source"] for e in [state["active"], *state["history"]]] == [three["update"], one["update"]]
    assert all(entry_verifies(bundle, e) for e in [state["active"], *state["history"]])
    assert active_lora(read_bundle(bundle)).file.name == state["active"]["file"]

    with bundle_lock(bundle, command="pytest holding the lock"):  # rollback: refused, or --wait
        one_error_line(run(["edge-client", "rollback", "--bundle", str(bundle)], tmp_path),
                       f"pid {os.getpid()}", "(pytest holding the lock)")
        waiting = start(["edge-client", "rollback", "--wait", "--bundle", str(bundle)], tmp_path)
        stderr_line(waiting, "waiting:")
    assert finish(waiting).returncode == 0
    assert read_state(read_bundle(bundle))["active"]["file"] == state["history"][0]["file"]
    assert leftovers(bundle) == []


def test_refresh_is_refused_during_a_train_and_moves_its_result_after(bundle, world, tmp_path):
    gate = tmp_path / "gate"
    tensors = world / "runs" / "moved" / "round-0002" / "global.safetensors"
    first = start(train(bundle, world, tmp_path / "u1", "--json"), tmp_path, gate, APPLY)
    pid = reached(gate, first)
    before = unlocked(tree_bytes(bundle))
    refused = run(["python", "-c", REFRESH, str(bundle), str(tensors)], tmp_path)
    one_error_line(refused, f"{bundle / '.lock'}: bundle in use by pid {pid}", "(edge-client train)")
    assert unlocked(tree_bytes(bundle)) == before

    gate.touch()
    trained = finish(first)
    assert trained.returncode == 0, trained.stderr[-2000:]
    entry = read_state(read_bundle(bundle))["active"]
    refreshed = run(["python", "-c", REFRESH, str(bundle), str(tensors)], tmp_path)
    assert refreshed.returncode == 0, refreshed.stderr[-2000:]
    assert read_bundle(bundle).round == 2 and not (bundle / "personalised").exists()
    kept = json.loads((bundle / "previous" / "personalised" / "state.json").read_text())["active"]
    assert kept == entry and entry_verifies(bundle / "previous", entry)  # the train's result, kept for rollback
    assert leftovers(bundle) == []


def test_a_killed_holder_of_the_bundle_is_taken_over_with_a_warning(bundle, tmp_path):
    holder = start(["python", "-c", HOLD, str(bundle)], tmp_path)
    assert holder.stdout.readline() == "held\n"
    os.kill(holder.pid, signal.SIGKILL)
    holder.communicate()
    done = run(["edge-client", "rollback", "--bundle", str(bundle)], tmp_path)
    assert done.returncode == 1 and "nothing to roll back" in done.stderr  # it ran, under the lock it took over
    warning = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and f"{bundle / '.lock'}: taking over the lock of pid {holder.pid} " in warning[0]
    assert "(a holder to be killed): that process is gone" in warning[0]
    assert leftovers(bundle) == []
