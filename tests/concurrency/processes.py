"""Real commands as separate processes, made to overlap deterministically.

`start` runs a console script; with a gate it runs it through paused.py, which stops the command
at one function (holding whatever lock it took) until the test opens the gate. `reached` waits
for that stop, `stderr_line` for a line such as "waiting: ...".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.deadlines import scaled
from tests.hostile.disk import BIN

PAUSED = Path(__file__).with_name("paused.py")
REPO = Path(__file__).resolve().parents[2]
SECONDS = scaled(240)  # what any one command may take on a loaded test machine
APPLY = "edge_client.train:apply_update_bytes"  # where a train stops: trained, update written, not yet applied


def env() -> dict[str, str]:
    """This checkout first on the path of every child (console scripts and `python paused.py`)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1"}


def start(args: list[str], cwd: Path, gate: Path | None = None, pause_at: str | None = None) -> subprocess.Popen:
    """A console script (``args[0]``: fedmvp, fedmvp-export, edge-client; "python": this interpreter)
    as a real process; with ``gate``, run through paused.py, which stops at ``pause_at`` until the
    gate opens."""
    if gate is not None:
        command = [sys.executable, str(PAUSED), str(gate), str(pause_at), *args]
    else:
        command = [sys.executable if args[0] == "python" else str(BIN / args[0]), *args[1:]]
    return subprocess.Popen(command, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = process.communicate(timeout=SECONDS)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return finish(start(args, cwd))


def reached(gate: Path, process: subprocess.Popen) -> int:
    """Wait until the paused command stands at its pause (holding its lock); its pid."""
    marker = Path(f"{gate}.reached")
    deadline = time.monotonic() + SECONDS
    while not marker.exists():
        if process.poll() is not None:
            raise AssertionError(f"ended before its pause:\n{finish(process).stderr[-3000:]}")
        assert time.monotonic() < deadline, "never reached its pause"
        time.sleep(0.05)
    return int(marker.read_text())


def stderr_line(process: subprocess.Popen, fragment: str) -> str:
    """Read the command's stderr up to the first line holding ``fragment`` (it is still running)."""
    seen = []
    for line in process.stderr:
        seen.append(line)
        if fragment in line:
            return line
    raise AssertionError(f"no line with {fragment!r} before the command ended:\n{''.join(seen)[-3000:]}")


def one_error_line(done: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 2, nothing on stdout, one stderr line holding every fragment."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    assert all(f in lines[0] for f in fragments), lines[0]
    return lines[0]


def leftovers(root: Path) -> list[str]:
    """Temp files and folders, lock files and refresh scratch anywhere under ``root`` (none may stay)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.name == ".lock" or ".tmp" in p.name or p.name.startswith((".refresh", ".personalised"))
                  or ".old-" in p.name)


def holder(path: Path) -> dict:
    return json.loads((path / ".lock").read_text())


def train(bundle: Path, world: Path, out: Path, *extra: str) -> list[str]:
    """`edge-client train` of one short epoch on the world's local images."""
    return ["edge-client", "train", "--bundle", str(bundle), "--data", str(world / "local"), "--out", str(out),
            "--epochs", "1", "--batch-size", "4", "--threads", "1", *extra]


def unlocked(tree: dict[str, bytes]) -> dict[str, bytes]:
    """A bundle's files but the lock file (which exists while a command holds the bundle)."""
    return {name: data for name, data in tree.items() if name != ".lock"}
