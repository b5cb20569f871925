"""How `fedmvp serve`, `fedmvp join` and `edge-client join` live and stop, with real processes on
127.0.0.1 (docs/security.md, the local user row; docs/tutorials/across-machines.md, "Stopping").

One deployment serves the stage test (its cost): a served run with a site and an edge device. While
a round runs, no process of the deployment carries a secret on its command line or in its
environment (the ServerApp's Runtime API token, the operator token, either SuperExec secret). Then
`serve` is stopped, and started again on the same run (a copy of its preset by a relative path,
once: that resumes), at each stage of a run: training, starting, evaluating, between rounds, and
while it waits on a round whose nodes were stopped; the site and the device are stopped mid-round,
then a new join of each while starting. Each, by Ctrl-C (SIGINT) or SIGTERM, exits within
``BOUND`` seconds with its one line, and leaves no process of its own behind. Beneath them, the
bound holds even where the orderly stop blocks (a watchdog), and a running command ends at once.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedmvp_apps.deploy.node_lines import FLOWER_LOG_ENV
from fedmvp_apps.deploy.stopping import STOP_BOUND, alive, descendants, kill_pids
from tests.deadlines import scaled
from tests.federated.processes import ENV, FEDMVP, Processes
from tests.federated.test_edge_join import local_folder, prepare_run


BOUND = STOP_BOUND
TASK_TOKEN = re.compile(rb"[0-9a-f]{256}")  # Flower's task tokens: token_hex(128)


def _group(pgid: int) -> list[int]:
    """The running processes of process group ``pgid`` (each command here starts its own)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:
                found.append(int(entry.name))
    return found


def _read(pid: int, name: str) -> bytes:
    try:
        return (Path("/proc") / str(pid) / name).read_bytes()
    except OSError:
        return b""


def _stop(procs: Processes, name: str, sig: int, line: str) -> float:
    """Signal ``name`` (its main process only, as a service manager would); it must exit within BOUND s
    with ``line`` in its log and nothing of its process group left. The seconds it took."""
    proc = procs.procs[name]
    family = descendants(proc.pid)
    assert proc.poll() is None, procs.log(name)[-3000:]
    started = time.monotonic()
    os.kill(proc.pid, sig)
    try:
        proc.wait(timeout=BOUND)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} did not exit within {BOUND:g} s of {signal.Signals(sig).name}\n{procs.log(name)[-3000:]}")
    took = time.monotonic() - started
    time.sleep(0.3)
    left = _group(proc.pid)
    assert not left and not alive(family), f"{name} left {left} running: {[_read(p, 'cmdline') for p in left]}"
    assert line in procs.log(name), procs.log(name)[-3000:]
    return took


def _count(procs: Processes, name: str, text: str) -> int:
    """How often Flower's log of join ``name`` says ``text`` (its terminal shows our lines only)."""
    path = procs.root / f"{name}.flower.log"
    return path.read_text(errors="replace").count(text) if path.exists() else 0


def _secrets(tmp_path: Path, run: Path, pgids: list[int]) -> None:
    """No process of the deployment shows a secret on its command line or in its environment."""
    home = run.parent / f".{run.name}.flwr"
    secrets = [(home / "operator.token").read_bytes().strip(), (home / "superexec.secret").read_bytes().strip()]
    pids = [pid for pgid in pgids for pid in _group(pgid)]
    shown = {pid: (_read(pid, "cmdline"), _read(pid, "environ")) for pid in pids}
    roles = {pid: cmdline.replace(b"\0", b" ").decode(errors="replace") for pid, (cmdline, _) in shown.items()}
    assert any("serverapp_process" in role or "flwr-serverapp" in role for role in roles.values()), roles
    assert any("warm_executor" in role for role in roles.values()), roles
    for pid, role in roles.items():
        if "--secret-file" in role:  # a join's own SuperExec secret: random bytes in a 0600 file
            path = Path(role.split("--secret-file ", 1)[1].split()[0])
            assert path.stat().st_mode & 0o077 == 0
            secrets.append(path.read_bytes())
    for pid, (cmdline, environ) in shown.items():
        for secret in secrets:
            assert secret not in cmdline and secret not in environ, f"a secret is shown by {roles[pid]}"
            assert secret.hex().encode() not in cmdline + environ, f"a secret is shown by {roles[pid]}"
        assert not TASK_TOKEN.search(cmdline) and not TASK_TOKEN.search(environ), \
            f"a Runtime API token is shown by {roles[pid]}"


@pytest.mark.slow  # every command stopped at every stage, each restarted
@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
@pytest.mark.timeout(420)
def test_no_secret_is_shown_and_every_command_stops_within_its_bound_at_every_stage(tmp_path, small_world):
    from edge_client.bundle import Bundle
    from export.bundle_writer import export_bundle
    from fedmvp_apps.deploy.supernode import free_port

    preset, run = prepare_run(tmp_path, small_world, rounds=40)
    export_bundle(run, 2, tmp_path / "device" / "bundle")
    classes = Bundle.open(tmp_path / "device" / "bundle").class_names
    local = local_folder(small_world, classes[:2], 4, tmp_path / "device" / "local")
    shutil.copy(preset, tmp_path / "copy.toml")  # the same preset by another path resumes the run
    port = free_port()
    link = f"127.0.0.1:{port}"
    edge_client = [str(Path(sys.executable).parent / "edge-client"), "join"]
    site = ["join", "--superlink", link, "--config", str(preset), "--insecure", "--site", "0", "--threads", "1"]
    edge = ["--superlink", link, "--bundle", str(tmp_path / "device" / "bundle"), "--data", str(local), "--insecure",
            "--epochs", "1", "--eval-fraction", "0.25", "--threads", "1"]
    procs = Processes(tmp_path)
    took: dict[str, float] = {}

    def serve(name: str, config: str = str(preset)) -> None:
        procs.start(name, ["serve", "--config", config, "--run-dir", str(run), "--insecure", "--address", link,
                           "--min-nodes", "2", "--round-timeout", "60", "--eval-every", "1"])

    def when(what: str, done, timeout: float = 120, watch: str = "serve") -> None:
        procs.wait_for(what, done, timeout, watch=watch)

    try:
        serve("serve")
        when("the SuperLink", lambda: "SuperLink listening" in procs.log("serve"))
        for name, args, command in (("site", site, None), ("edge", edge, edge_client)):  # Flower's log kept
            procs.start(name, args, command=command, env={**ENV, FLOWER_LOG_ENV: str(tmp_path / f"{name}.flower.log")})
        when("round 3's training", lambda: _count(procs, "site", "Receiving: train message") >= 1, 240)
        _secrets(tmp_path, run, [procs.procs[name].pid for name in ("serve", "site", "edge")])
        took["serve training SIGINT"] = _stop(procs, "serve", signal.SIGINT, "serve: interrupted: run ")

        serve("serve-2")
        when("the SuperLink", lambda: "SuperLink listening" in procs.log("serve-2"), watch="serve-2")
        took["serve starting SIGTERM"] = _stop(procs, "serve-2", signal.SIGTERM, "serve: interrupted")

        evaluated = _count(procs, "site", "Receiving: evaluate message")
        serve("serve-3", "copy.toml")  # relative, in the command's folder
        when("an evaluation", lambda: _count(procs, "site", "Receiving: evaluate message") > evaluated, 180, "serve-3")
        took["serve evaluating SIGTERM"] = _stop(procs, "serve-3", signal.SIGTERM, "serve: interrupted: run ")

        rounds = len(list(run.glob("round-*/state.json")))
        serve("serve-4")
        when("a round's end", lambda: len(list(run.glob("round-*/state.json"))) > rounds, 240, "serve-4")
        took["serve between rounds SIGINT"] = _stop(procs, "serve-4", signal.SIGINT, "serve: interrupted: run ")

        trained = {name: _count(procs, name, "Receiving: train message") for name in ("site", "edge")}
        serve("serve-5")
        when("a round's training", lambda: all(_count(procs, n, "Receiving: train message") > trained[n]
                                               for n in trained), 180, "serve-5")
        took["site mid-round SIGTERM"] = _stop(procs, "site", signal.SIGTERM, "join: stopped (SIGTERM)")
        took["edge mid-round SIGINT"] = _stop(procs, "edge", signal.SIGINT, "edge-client join: stopped (Ctrl-C)")
        took["serve waiting SIGTERM"] = _stop(procs, "serve-5", signal.SIGTERM, "serve: interrupted: run ")

        for name, args, command, sig, line in (
                ("site-2", site, None, signal.SIGINT, "join: stopped (Ctrl-C)"),
                ("edge-2", edge, edge_client, signal.SIGTERM, "edge-client join: stopped (SIGTERM)")):
            proc = procs.start(name, args, command=command)
            when("its SuperNode", lambda: any("supernode_process" in _read(p, "cmdline").decode(errors="replace")
                                              for p in descendants(proc.pid)), 60, name)
            took[f"{name.split('-')[0]} starting {signal.Signals(sig).name}"] = _stop(procs, name, sig, line)
    finally:
        procs.stop()
    print("seconds to stop:", {k: round(v, 1) for k, v in took.items()})
    serve_logs = "".join(procs.log(n) for n in ("serve", "serve-2", "serve-3", "serve-4", "serve-5"))
    assert "Traceback" not in serve_logs and "Aborted!" not in serve_logs, serve_logs[-3000:]
    assert "not the preset" not in procs.log("serve-3")


BLOCKED = '''
import subprocess, sys, time
from fedmvp_apps.deploy.stopping import Stopper, run_interruptible

with Stopper("blocked: stopped") as stopper:
    subprocess.Popen(["sleep", "120"], stderr=subprocess.DEVNULL)  # a child it never stops itself
    if sys.argv[1] == "block":
        time.sleep(120)  # whatever blocks the orderly stop: a wait without a bound, a held lock
    else:
        try:
            run_interruptible(["sleep", "120"], stopper, timeout=120)
        except Exception as err:
            print(f"stopped in order: {type(err).__name__}", file=sys.stderr, flush=True)
'''


@pytest.mark.timed  # asserts on the wall clock: runs where the cores go first (docs/testing.md)
@pytest.mark.processes  # starts real processes (see pyproject.toml markers)
@pytest.mark.parametrize("how, sig", [("block", signal.SIGTERM), ("order", signal.SIGTERM), ("order", signal.SIGHUP)])
def test_a_stop_is_bounded_whatever_blocks_and_kills_every_descendant(tmp_path, how, sig):
    """The guarantee under the commands' stops: SIGTERM ends the process within STOP_BOUND seconds even
    when its main thread never looks at the event again (the watchdog kills its descendants and exits
    with its line); where it does look, a running command is ended at once. SIGHUP (an operator's SSH
    session closing) is a stop like SIGTERM: it used to kill `serve` at once and orphan its SuperLink."""
    script = tmp_path / "blocked.py"
    script.write_text(BLOCKED)
    proc = subprocess.Popen([sys.executable, str(script), how], env=ENV, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + scaled(60)
    while len(descendants(proc.pid)) < (1 if how == "block" else 2):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    family = descendants(proc.pid)
    started = time.monotonic()
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=BOUND + 5)
    took = time.monotonic() - started
    assert took < BOUND
    if how == "block":
        assert took > BOUND - 2 and proc.returncode == 1 and "blocked: stopped (the orderly stop overran" in err, err
    else:
        assert took < 3 and "stopped in order: Interrupted" in err, err
    time.sleep(0.3)
    if how == "block":
        assert not alive(family)
    else:
        kill_pids(family)
