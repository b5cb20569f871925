"""The run lock: one writer of a run directory's rounds at a time (`fedmvp ingest`, `fedmvp train`,
the Flower server).

Why: two `fedmvp ingest` on one run both read round R and both wrote round R+1, and one of
them replaced the other's round without a word: a device's update was lost. An ingest now
holds ``RUN/.lock`` from reading round R to writing R+1; a second one is refused with one line
naming the holder (`RunBusy`, exit 2: the run is unchanged by it) or, asked to wait, writes
R+2 on top. The Flower server holds it while it writes rounds (`run_server`), and `fedmvp train`
(fresh or ``--resume``) from before it reads the run until the simulation ended: an ingest during a
live training, or a second ``--resume``, is refused (or waits) the same way.

Re-entrant within one process ("held by this process"): in simulation Flower runs the ServerApp
in a thread of `fedmvp train`'s own process, so the server's ``run_lock`` finds the lock held by
its process and goes on without locking again; the outer holder's record and flock stay as they
are. A deployed ServerApp runs in a process of its own (Flower's SuperExec) and takes the lock
itself. Only the process counts, not its children: the fd is close-on-exec, and a forked child
inherits the registry but not the ownership (it compares its pid), so it neither shares nor
releases the lock.

``fcntl.flock`` on ``RUN/.lock``, which holds the holder's record (pid, host, since, command)
and exists only while held: it is removed, still locked, before it is released, so a run
directory an ingest refused is byte for byte what it was. A waiter that locked a file meanwhile
removed locks the new one. A holder killed with SIGKILL loses its flock in the kernel; its
record stays, and the next holder warns that it takes the lock over. The record is written in
place, not through ``atomic`` (a renamed file would be another lock). POSIX only; elsewhere
nothing is locked.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fedmvp.runs import RunError, warn

LOCK_NAME = ".lock"
_HELD: dict[str, int] = {}  # lock path (resolved) -> pid of the process that holds it (see "re-entrant")


class RunBusy(RunError):
    """Another process holds the run's lock; the message names it (pid, host, since, command)."""


def holder_line(record: dict[str, Any] | None) -> str:
    """Who holds (or held) a lock, for one line of text."""
    if not record:
        return "another process (no readable record of it)"
    return "pid {pid} on {host} since {since} ({command})".format(**{
        key: record.get(key, "?") for key in ("pid", "host", "since", "command")})


def run_lock(run_dir: str | os.PathLike, command: str, wait: float = 0.0, can_wait: bool = True) -> "RunLock":
    """``with run_lock(run, "fedmvp ingest", wait=30):`` holds ``RUN/.lock`` as ``command`` for the
    block; ``wait``: seconds to wait for another holder (0 refuses at once with `RunBusy`,
    ``math.inf`` waits as long as it takes); ``can_wait``: whether the refusal may suggest --wait."""
    return RunLock(run_dir, command, wait, can_wait)


class RunLock:
    """The run's lock as a context manager (`run_lock`)."""

    def __init__(self, run_dir: str | os.PathLike, command: str, wait: float = 0.0, can_wait: bool = True) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.command, self.wait, self.can_wait = command, wait, can_wait
        self.fd: int | None = None
        self.key = os.path.realpath(self.path)
        self.nested = False

    def __enter__(self) -> "RunLock":
        if _HELD.get(self.key) == os.getpid():
            self.nested = True  # this process holds it already (the simulated ServerApp): one writer
            return self
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX
            return self
        give_up = time.monotonic() + self.wait
        announced = False
        while self.fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                self._refuse_or_pause(give_up, announce=not announced)
                announced = True
                continue
            if self._names(fd):
                self.fd = fd
            else:
                os.close(fd)  # the holder removed it as we locked it: lock the current one
        _HELD[self.key] = os.getpid()
        try:
            self._take_over()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.nested:
            self.nested = False
            return
        if self.fd is not None:
            if _HELD.get(self.key) == os.getpid():  # not in a forked child: its copy of the fd releases nothing
                del _HELD[self.key]
                self.path.unlink(missing_ok=True)  # nothing renames a run directory while it is locked
            os.close(self.fd)
            self.fd = None

    def _refuse_or_pause(self, give_up: float, announce: bool) -> None:
        """`RunBusy` once the wait is over, else a pause (saying once whom it waits for)."""
        busy = f"{self.path}: run in use by {holder_line(self._holder())}"
        if time.monotonic() >= give_up:
            again = "try again when it ends" + (", or pass --wait" if self.can_wait else "")
            raise RunBusy(f"{busy}; nothing was written ({again})")
        if announce:
            print(f"waiting: {busy}", file=sys.stderr, flush=True)
        time.sleep(0.1)

    def _names(self, fd: int) -> bool:
        """Whether the lock path is still the file ``fd`` has open."""
        try:
            return os.path.samestat(os.stat(self.path), os.fstat(fd))
        except FileNotFoundError:
            return False

    def _holder(self) -> dict[str, Any] | None:
        """The holder's record, read again for a moment when it has only just locked."""
        for _ in range(20):
            try:
                record = json.loads(self.path.read_text(encoding="utf-8"))
                if isinstance(record, dict):
                    return record
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
        return None

    def _take_over(self) -> None:
        """Warn about a dead holder's record, then write this process's."""
        fd = self.fd
        old = os.pread(fd, 4096, 0)
        if old.strip():
            try:
                record = json.loads(old)
            except ValueError:
                record = None
            warn(f"{self.path}: taking over the lock of {holder_line(record)}: that process is gone")
        mine = {"pid": os.getpid(), "host": socket.gethostname(),
                "since": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "command": self.command}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(mine).encode("utf-8"), 0)


def lock_existing(run_dir: str | os.PathLike | None, command: str) -> contextlib.AbstractContextManager:
    """``run_lock`` when ``run_dir`` is an existing directory, else nothing: a writer that may create
    the run (fresh `fedmvp train`, a deployed ServerApp's first start) locks it early when it can, before
    it reads or writes config.json, and later again (re-entrant) once the directory exists."""
    if run_dir and Path(run_dir).is_dir():
        return run_lock(run_dir, command, can_wait=False)
    return contextlib.nullcontext()
