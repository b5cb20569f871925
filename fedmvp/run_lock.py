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

The lock is the project's one (``fedmvp_formats.holder_lock.HolderLock``): ``RUN/.lock`` holds the
holder's record (pid, host, since, command) and exists only while held, so a run directory an ingest
refused is byte for byte what it was. It is never written through a link: a ``.lock`` that is a symbolic
link or not a regular file is refused (one line, `RunError`, exit 2). A record of a holder killed on this
host is taken over with a warning; one naming another host is refused (`RunBusy`) unless the operator
passes ``break_lock`` (``--break-lock``): ``flock`` is local to each host on many shared file systems.
POSIX only; elsewhere nothing is locked.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from fedmvp_formats.holder_lock import BREAK_HINT, LOCK, HolderLock, LockBusy
from fedmvp_formats.nofollow import UnsafePath

from fedmvp.runs import RunError

LOCK_NAME = LOCK


class RunLockError(RunError):
    """The run's lock cannot be taken (held, held on another host, or its file is a link): nothing was
    written; the message is one line naming ``RUN/.lock``."""


class RunBusy(RunLockError):
    """Another process holds the run's lock; the message names it (pid, host, since, command)."""


def run_lock(run_dir: str | os.PathLike, command: str, wait: float = 0.0, can_wait: bool = True,
             break_lock: bool = False) -> "RunLock":
    """``with run_lock(run, "fedmvp ingest", wait=30):`` holds ``RUN/.lock`` as ``command`` for the
    block; ``wait``: seconds to wait for another holder (0 refuses at once with `RunBusy`,
    ``math.inf`` waits as long as it takes); ``can_wait``: whether the refusal may suggest --wait;
    ``break_lock``: take over a lock whose record names another host (the operator said it is gone)."""
    return RunLock(run_dir, command, wait, can_wait, break_lock)


class RunLock(HolderLock):
    """The run's lock as a context manager (`run_lock`): re-entrant in its process (see "Re-entrant")."""

    def __init__(self, run_dir: str | os.PathLike, command: str, wait: float = 0.0, can_wait: bool = True,
                 break_lock: bool = False) -> None:
        super().__init__(run_dir, command, "run", wait, break_lock, reentrant=True)
        self.can_wait = can_wait

    def unsafe(self, err: UnsafePath) -> Exception:
        return RunLockError(str(err))

    def busy(self, busy: LockBusy) -> Exception:
        """`RunBusy`'s one line: who holds the run, and what the operator can do."""
        wait = ", or pass --wait" if self.can_wait else ""
        if busy.elsewhere:
            return RunBusy(f"{busy.line}; nothing was written ({BREAK_HINT}{wait})")
        return RunBusy(f"{busy.line}; nothing was written (try again when it ends{wait})")


def lock_existing(run_dir: str | os.PathLike | None, command: str, break_lock: bool = False
                  ) -> contextlib.AbstractContextManager:
    """``run_lock`` when ``run_dir`` is an existing directory, else nothing: a writer that may create
    the run (fresh `fedmvp train`, a deployed ServerApp's first start) locks it early when it can, before
    it reads or writes config.json, and later again (re-entrant) once the directory exists."""
    if run_dir and Path(run_dir).is_dir():
        return run_lock(run_dir, command, can_wait=False, break_lock=break_lock)
    return contextlib.nullcontext()
