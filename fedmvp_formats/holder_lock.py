"""The one directory lock of the project: ``fcntl.flock`` on a ``.lock`` holding its holder's record.

`HolderLock` is the lock as a context manager, used by the run lock (``fedmvp.run_lock``), the bundle
lock (``edge_client.bundle_lock``) and the device state's personalisation lock
(``edge_client.lora_store``): each names what it guards ("run", "bundle"), the one-line errors of its
own package (``busy``, ``unsafe``) and whether it is re-entrant in one process (the run lock: the
simulated ServerApp runs in the process of `fedmvp train` that holds it). The personalisation lock is
the lock without a record (``record=False``): an flock of the directory itself, which adds no file to
the tree it guards. The ``.lock`` file holds the
holder's record (pid, host, since, command) and exists only while held: it is removed, still locked,
before it is released, so the directory it guards is byte for byte what it was. A waiter that locked a
file meanwhile removed (or left in a directory replaced meanwhile) locks the current one.

What it never does (docs/security.md, "Links planted in a run or a bundle"): write through a link. The
``.lock`` is opened with ``O_NOFOLLOW`` and must be a regular file with one name
(`fedmvp_formats.nofollow.open_nofollow`); a link or anything else there is refused in one line naming
it, and nothing is written.

A record left by a holder killed with SIGKILL (its flock went with it) is taken over with a warning when
it names this host: the kernel says no process of this host holds the lock. A record naming ANOTHER
host is not: ``flock`` is local to each host on many shared file systems, so that process may be
alive. The caller is refused with one line (host, pid, since) and the operator decides
(``break_lock``, the commands' ``--break-lock``). Standard library only; POSIX (elsewhere nothing is
locked).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fedmvp_formats.nofollow import UnsafePath, open_nofollow, path_shown, read_nofollow

LOCK = ".lock"
POLL_SECONDS = 0.1
BREAK_HINT = "if that process is gone, pass --break-lock"
_HELD: dict[str, int] = {}  # a re-entrant lock's path (resolved) -> pid of the process that holds it


class LockBusy(Exception):
    """Another process holds the lock (``line``: "PATH: <what> in use by <holder>")."""

    def __init__(self, line: str, elsewhere: bool = False) -> None:
        super().__init__(line)
        self.line, self.elsewhere = line, elsewhere


def describe(record: dict[str, Any] | None) -> str:
    """"pid 12 on host h since T (command)": who holds, or held, a lock."""
    if not record:
        return "another process (no readable record of it)"
    return "pid {pid} on {host} since {since} ({command})".format(**{
        key: record.get(key, "?") for key in ("pid", "host", "since", "command")})


def foreign(record: dict[str, Any] | None) -> bool:
    """Whether a record names a host other than this one (its process cannot be checked from here)."""
    return bool(record) and isinstance(record.get("host"), str) and record["host"] != socket.gethostname()


def _parse(data: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def read_record(path: Path, tries: int = 20) -> dict[str, Any] | None:
    """The holder's record; it may be a moment from being written (the holder has just locked)."""
    for _ in range(tries):
        try:
            record = _parse(read_nofollow(path))
        except OSError:
            record = None
        if record is not None:
            return record
        time.sleep(0.02)
    return None


def is_current(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not removed, not replaced, not a link)."""
    try:
        here, held = os.lstat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def acquire(path: Path, command: str, wait: float, what: str, break_lock: bool = False,
            unlockable: Callable[[OSError], bool] = lambda err: False) -> int | None:
    """The locked ``path``'s descriptor with this process's record written. ``wait``: seconds to wait for
    another holder (``math.inf``: as long as it takes), then `LockBusy`; ``what``: "run", "bundle" (the
    busy line says "<what> in use by ..."); ``break_lock``: take over a record of another host;
    ``unlockable(err)``: an open error meaning "nothing to lock here" (None is returned). `UnsafePath` when
    ``path`` is a link or not a regular file."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return None
    deadline, announced = time.monotonic() + wait, False
    while True:
        try:
            fd = open_nofollow(path, os.O_RDWR | os.O_CREAT)
        except UnsafePath:
            raise
        except OSError as err:
            if unlockable(err):
                return None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            busy = LockBusy(f"{path_shown(path)}: {what} in use by {describe(read_record(path))}")
        else:
            if not is_current(fd, path):
                os.close(fd)  # removed, or its directory replaced, while we waited: lock the current file
                continue
            record = _parse(os.pread(fd, 4096, 0))
            if not foreign(record) or break_lock:
                break
            _unlock_without_removing(fd)
            busy = LockBusy(f"{path_shown(path)}: {what} in use by {describe(record)} according to its lock "
                            f"record; a lock taken on another host cannot be checked from here", elsewhere=True)
        if time.monotonic() >= deadline:
            raise busy
        if not announced:
            hint = f" ({BREAK_HINT})" if busy.elsewhere else ""
            print(f"waiting: {busy.line}{hint}", file=sys.stderr, flush=True)
            announced = True
        time.sleep(POLL_SECONDS)
    try:
        _write_record(fd, path, command, record)
    except BaseException:
        release(fd, path)
        raise
    return fd


def _unlock_without_removing(fd: int) -> None:
    import fcntl

    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _write_record(fd: int, path: Path, command: str, stale: dict[str, Any] | None) -> None:
    """Say so when the lock's last holder died holding it (or the operator broke another host's lock),
    then record this process as the holder (in place: the file's identity is the lock)."""
    if stale is not None or os.fstat(fd).st_size:
        why = ("broken on request (--break-lock)" if foreign(stale) else "that process is gone")
        print(f"warning: {path_shown(path)}: taking over the lock of {describe(stale)}: {why}",
              file=sys.stderr, flush=True)
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "since": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "command": command}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode("utf-8"), 0)


def release(fd: int, path: Path) -> None:
    """Remove the lock file (unless it is no longer the one held: its directory was replaced) and unlock."""
    if is_current(fd, path):
        path.unlink(missing_ok=True)
    os.close(fd)


def _never(err: OSError) -> bool:
    return False


class HolderLock:
    """Hold ``DIRECTORY/.lock`` (``record=True``, the holder's record in it) or an flock of the directory
    itself (``record=False``: blocking, nothing written) for a ``with`` block.

    ``command``: what the record calls this process; ``what``: the busy line's noun ("run in use by
    ..."); ``wait``: seconds to wait for another holder (0: refuse at once, ``math.inf``: as long as it
    takes); ``break_lock``: take over a record naming another host (``--break-lock``); ``reentrant``: a
    second ``with`` of the same lock in the holding process goes on without locking again (only the
    process counts, not a forked child: it neither shares nor releases the lock); ``unlockable(err)``:
    an open error meaning "nothing to lock here" (the block runs unlocked). A subclass turns the two
    refusals into its package's errors (``busy``, ``unsafe``)."""

    def __init__(self, directory: str | os.PathLike, command: str = "", what: str = "directory",
                 wait: float = 0.0, break_lock: bool = False, *, record: bool = True, reentrant: bool = False,
                 unlockable: Callable[[OSError], bool] = _never) -> None:
        self.path = Path(directory) / LOCK if record else Path(directory)
        self.command, self.what, self.wait, self.break_lock = command, what, wait, break_lock
        self.record, self.reentrant, self.unlockable = record, reentrant, unlockable
        self.key = os.path.realpath(self.path)
        self.fd: int | None = None
        self.nested = False

    def busy(self, busy: LockBusy) -> Exception:
        """The refusal when another process holds the lock (the one line is ``busy.line``)."""
        return busy

    def unsafe(self, err: UnsafePath) -> Exception:
        """The refusal when the ``.lock`` is a link or not a regular file."""
        return err

    def __enter__(self) -> "HolderLock":
        if self.reentrant and _HELD.get(self.key) == os.getpid():
            self.nested = True  # this process holds it already: one holder
            return self
        try:
            self.fd = (acquire(self.path, self.command, self.wait, self.what, self.break_lock, self.unlockable)
                       if self.record else _flock_whole(self.path))
        except UnsafePath as err:
            raise self.unsafe(err) from None
        except LockBusy as busy:
            raise self.busy(busy) from None
        if self.fd is not None and self.reentrant:
            _HELD[self.key] = os.getpid()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.nested:
            self.nested = False
            return
        fd, self.fd = self.fd, None
        if fd is None:
            return
        if self.reentrant:
            if _HELD.get(self.key) != os.getpid():
                os.close(fd)  # a forked child: its copy of the fd releases nothing
                return
            del _HELD[self.key]
        if self.record:
            release(fd, self.path)
        else:
            os.close(fd)  # releases the flock


def _flock_whole(directory: Path) -> int | None:
    """An exclusive flock of ``directory`` itself (blocking); None where ``fcntl`` is missing."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return None
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd
