"""A watchdog for `fedmvp train` / `fedmvp demo`: when the process dies (even by kill -9), the helper
processes it started die with it.

Why: Ray's raylet starts ``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent`` (~90 MB each); when the
driver is killed with SIGKILL, the raylet and GCS notice and exit, but these two are orphaned and live
on. The watchdog is a tiny child in its own session (Ctrl-C does not reach it) that, while its parent
lives, records the parent's descendants (pid and start time, so a reused pid is never hit); once the
parent is gone it SIGKILLs those still running. Linux only (it reads /proc); elsewhere it is not started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.5


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live, non-zombie process; None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live descendant of ``root``."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                children.setdefault(stat[0], []).append(int(entry))
                starts[int(entry)] = stat[1]
    found, stack = {}, list(children.get(root, []))
    while stack:
        pid = stack.pop()
        if pid not in found:
            found[pid] = starts[pid]
            stack.extend(children.get(pid, []))
    return found


def watch(parent: int) -> None:
    """Record ``parent``'s descendants until it is gone, then kill the ones still running."""
    me = os.getpid()
    tracked: dict[int, int] = {}
    while os.getppid() == parent:  # reparented: the parent died
        tracked.update({pid: start for pid, start in descendants(parent).items() if pid != me})
        time.sleep(POLL_S)
    for pid, start in tracked.items():
        stat = _stat(pid)
        if stat is not None and stat[1] == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def start_watchdog() -> subprocess.Popen | None:
    """Start the watchdog for this process (None where /proc is missing)."""
    if not sys.platform.startswith("linux") or not Path("/proc/self/stat").exists():
        return None
    global _WATCHDOG
    # -I and this file run as a script: the watchdog imports the standard library only (a few MB).
    _WATCHDOG = subprocess.Popen([sys.executable, "-I", __file__, str(os.getpid())], start_new_session=True,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return _WATCHDOG


_WATCHDOG: subprocess.Popen | None = None


if __name__ == "__main__":
    watch(int(sys.argv[1]))
