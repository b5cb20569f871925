"""A running `fedmvp train`, as an outsider on the network and as an operator stopping it would see it.

Rows (docs/security.md "Listeners", docs/tutorials/one-machine.md "Stopping and resuming"):
- every port the simulation's process tree listens on is loopback or refuses a caller without the run's
  token: each of Ray's gRPC servers answers UNAUTHENTICATED to its own service's methods (what attaching
  to the cluster and running code through it use: another process could otherwise run code as the user),
  its HTTP agent 401;
- SIGTERM mid-run ends it within the stop bound with one line (what is kept, how to resume), exit 143,
  no Ray crash dump, and no process of its tree left;
- the same command works again at once (`--resume`, the dead holder's lock taken over), and Ctrl-C ends
  that one too (exit 130, nothing left).
One simulation of the small world; the resume is stopped before it trains.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.deadlines import scaled
from tests.federated.conftest import preset_file, small_world  # noqa: F401 (the small world's preset)
from tests.listeners import listeners

STOP_BOUND = 15.0


def _tree(pid: int) -> set[int]:
    from fedmvp_apps.deploy.stopping import descendants

    return {pid, *descendants(pid)}


def _wait_for(what: str, ready, proc: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + scaled(seconds)
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"fedmvp train exited ({proc.returncode}) while waiting for {what}: "
                                 f"{proc.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"no {what} within {scaled(seconds):g} s"
        time.sleep(0.2)


def _stop(proc: subprocess.Popen, sig: int) -> tuple[float, str]:
    tree = _tree(proc.pid)
    began = time.monotonic()
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=scaled(STOP_BOUND))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"fedmvp train did not end within {STOP_BOUND:g} s of signal {sig}") from None
    took = time.monotonic() - began
    deadline = time.monotonic() + 5
    while (left := {p for p in tree if Path(f"/proc/{p}").exists() and _alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"left running after the stop: {sorted(left)}"
    return took, err


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# One method of each Ray gRPC service (the GCS's, a raylet's node manager and object manager, a worker's and
# the driver's core worker): each server answers UNAUTHENTICATED for its own service's methods without the
# token, UNIMPLEMENTED for the others'. gRPC's health check answers anyone and tells nothing.
RAY_METHODS = ("/ray.rpc.NodeInfoGcsService/GetAllNodeInfo", "/ray.rpc.NodeManagerService/GetNodeStats",
               "/ray.rpc.ObjectManagerService/Pull", "/ray.rpc.CoreWorkerService/NumPendingTasks")


def _grpc_verdicts(port: int) -> set[str]:
    """What a caller without the token gets from a gRPC listener, for each Ray service's method (empty
    bytes: the request is never read when the call is refused first)."""
    import grpc

    verdicts = set()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        for method in RAY_METHODS:
            call = channel.unary_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            try:
                call(b"", timeout=scaled(10))
                verdicts.add("OK")
            except grpc.RpcError as err:
                verdicts.add(err.code().name)
    return verdicts


def _http_status(host: str, port: int) -> int:
    try:
        return urllib.request.urlopen(f"http://{host}:{port}/", timeout=scaled(10)).status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.mark.deployment  # a Ray simulation (`fedmvp train`)
@pytest.mark.timeout(400)
def test_a_simulation_listens_only_behind_its_token_and_every_signal_ends_it_whole(tmp_path, preset_file):
    preset_file.write_text(preset_file.read_text().replace("rounds = 3", "rounds = 20"))
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "fedmvp_apps.cli", "train", "--config", str(preset_file), "--run-dir", str(run)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        _wait_for("round 1", lambda: (run / "round-0001" / "state.json").exists(), proc, 240)
        found = listeners(_tree(proc.pid))
        assert any(entry.name == "gcs_server" for entry in found), found
        for entry in found:  # loopback, or refusing whoever lacks the run's token
            if entry.loopback:
                continue
            if "RuntimeEnv" in entry.name:  # the runtime-env agent speaks HTTP
                assert _http_status(entry.host, entry.port) == 401, entry
            else:  # the GCS, raylets, workers and the driver's core worker speak gRPC
                verdicts = _grpc_verdicts(entry.port)
                assert "UNAUTHENTICATED" in verdicts and "OK" not in verdicts, (entry, verdicts)

        took, err = _stop(proc, signal.SIGTERM)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM and took < STOP_BOUND
    lines = [line for line in err.splitlines() if "stopped by" in line]
    assert lines and lines[-1].startswith("fedmvp train: stopped by SIGTERM; rounds up to ")
    assert f"`fedmvp train --resume --run-dir {run}` continues" in lines[-1]
    assert "SIGTERM received" not in err and "Traceback" not in err  # no native dump, no traceback

    again = subprocess.Popen([*command[:-2], "--resume", "--run-dir", str(run)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        _wait_for("the resumed run's lock", lambda: _holds_lock(run, again.pid), again, 120)
        took, err = _stop(again, signal.SIGINT)
    finally:
        if again.poll() is None:
            os.killpg(again.pid, signal.SIGKILL)
    assert again.returncode == 128 + signal.SIGINT and took < STOP_BOUND
    assert "fedmvp train: stopped by Ctrl-C; rounds up to" in err and "Traceback" not in err


def _holds_lock(run: Path, pid: int) -> bool:
    """The run's lock record names ``pid`` (RUN/.lock: fedmvp.run_lock)."""
    try:
        return json.loads((run / ".lock").read_text()).get("pid") == pid
    except (OSError, ValueError):
        return False


def test_the_token_is_the_processs_own_and_readable_only_by_its_user():
    from fedmvp.federated.ray_token import MODE, PATH, ensure_ray_token

    ensure_ray_token()  # this process's (tests/conftest.py drew it before anything loaded Ray)
    path = Path(os.environ[PATH])
    assert os.environ[MODE] == "token" and len(path.read_text()) == 64
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert str(path) not in " ".join(sys.argv)


@pytest.mark.deployment  # a fresh interpreter that loads Ray first (judged a Ray process; it starts no cluster)
def test_a_process_that_loaded_ray_without_a_token_is_refused_not_started_open(tmp_path):
    from fedmvp.federated.ray_token import MODE, PATH, VALUE

    env = {k: v for k, v in os.environ.items() if k not in (MODE, PATH, VALUE)}
    code = ("import ray._raylet\nfrom fedmvp.federated.ray_token import RayTokenError, ensure_ray_token\n"
            "try:\n    ensure_ray_token()\nexcept RayTokenError as err:\n    print(err)\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=scaled(120),
                          cwd=Path(__file__).resolve().parents[2])
    assert done.stdout.startswith("Ray was loaded in this process before fedmvp could give its cluster a token")
    assert len(done.stdout.strip().splitlines()) == 1
