"""A join is a SuperNode plus one warm ClientApp executor (fedmvp_apps/deploy/supernode.py), stopped
together: the executor dying ends the join non-zero with one line, the SuperNode dying or the join
being stopped leaves nothing running. No SuperLink is needed: the SuperNode keeps trying to reach one.
That the executor runs every message in one process is shown by the deploy benchmark's --quick run
(tests/benchmarks/test_sections.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedmvp_apps.deploy.node_lines import FLOWER_LOG_ENV
from fedmvp_apps.deploy.supernode import free_port
from tests.deadlines import scaled

pytestmark = [pytest.mark.deployment,  # starts real processes (see pyproject.toml markers)
              pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc for the children")]
ENV = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "PYTHONUNBUFFERED": "1"}


def children(pid: int) -> dict[int, str]:
    """pid -> command line of each live child of ``pid``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found[int(entry.name)] = cmdline
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def start_join(tmp_path: Path) -> tuple[subprocess.Popen, int, int]:
    """`fedmvp join` towards a port nobody listens on; (join, its SuperNode's pid, its executor's pid)."""
    log = open(tmp_path / "join.log", "wb")
    flower_log = tmp_path / "flower.log"  # Flower's whole log: the executor's "successful" is said there
    join = subprocess.Popen([sys.executable, "-m", "fedmvp_apps.cli", "join", "--superlink",
                             f"127.0.0.1:{free_port()}", "--config", "demo", "--site", "0", "--insecure"],
                            env={**ENV, FLOWER_LOG_ENV: str(flower_log)}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.time() + scaled(60)
    while True:
        kids = children(join.pid)
        supernode = [p for p, c in kids.items() if "supernode_process" in c]
        executor = [p for p, c in kids.items() if "warm_executor" in c]
        if supernode and executor:
            break
        assert join.poll() is None and time.time() < deadline, (tmp_path / "join.log").read_text()
        time.sleep(0.2)
    args = kids[supernode[0]]
    assert "--isolation process" in args and "--host 127.0.0.1" in args and "--superexec-auth-secret-file" in args
    while not (flower_log.is_file() and "executor: INFO :      Connection successful" in flower_log.read_text()):
        assert join.poll() is None and time.time() < deadline, (tmp_path / "join.log").read_text()
        time.sleep(0.2)  # both up: the executor polls the SuperNode's Runtime API
    return join, supernode[0], executor[0]


def finish(join: subprocess.Popen, *pids: int) -> int:
    try:
        code = join.wait(timeout=scaled(40))
    finally:
        if join.poll() is None:
            os.killpg(join.pid, signal.SIGKILL)
    deadline = time.time() + scaled(20)
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids), "a child of the join outlived it"
    return code


@pytest.mark.timeout(180)
def test_a_dead_executor_stops_the_supernode_and_the_join_says_so_in_one_line(tmp_path):
    join, supernode, executor = start_join(tmp_path)
    os.kill(executor, signal.SIGKILL)
    assert finish(join, supernode, executor) != 0
    errors = [line for line in (tmp_path / "join.log").read_text().splitlines() if line.startswith("error:")]
    assert errors == [f"error: the ClientApp executor (pid {executor}) exited with code -9; stopping the SuperNode"]


@pytest.mark.timeout(180)
def test_a_dead_supernode_stops_the_executor(tmp_path):
    join, supernode, executor = start_join(tmp_path)
    os.kill(supernode, signal.SIGKILL)
    assert finish(join, supernode, executor) != 0
    assert "error: the ClientApp executor" not in (tmp_path / "join.log").read_text()


@pytest.mark.timeout(180)
def test_stopping_the_join_stops_both(tmp_path):
    join, supernode, executor = start_join(tmp_path)
    join.send_signal(signal.SIGTERM)  # the join alone, as a service manager stops it
    assert finish(join, supernode, executor) == 0
