"""The bundle lock: one command at a time changes a bundle (train, refresh, rollback, export --force).

Why: two `edge-client train` on one bundle both started from the same active LoRA, so the
second discarded what the first had learnt; a refresh moved ``personalised/`` and the files
under a running train, whose update then belonged to neither bundle; `fedmvp-export --force`
replaced the directory a train was about to personalise. Each of these now holds
``BUNDLE/.lock`` for its whole read-modify-write: a second one is refused with one line
naming the holder (`BundleBusy`), or waits for it (``wait`` seconds, ``math.inf``: as long as
it takes). Inference takes no lock: it must keep working while a device trains (it reloads
instead when the directory is replaced under it, ``edge_client.infer``).

The lock is an ``fcntl.flock`` on ``.lock``, which holds the holder's record (pid, host,
since, command) and exists only while held: it is removed (still locked) before it is
released, so the bundle's tree stays what the exporter and a refresh wrote. A waiter that
locked a file meanwhile removed, or left behind in a directory `fedmvp-export --force`
replaced, tries again on the current one. A holder killed with SIGKILL loses its flock in
the kernel; its record stays, and whoever locks next says that it takes the lock over.
The record is written in place, not renamed: the file's identity is the lock.

``personalised/state.json``'s own short lock (``lora_store.personalisation_lock``, an flock
of the directory) is another file, so holding both never deadlocks. A bundle directory this
process cannot write to is not locked: it cannot change the bundle either. Standard library only.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from edge_client.bundle import BundleError

LOCK = ".lock"
POLL_SECONDS = 0.1


class BundleBusy(BundleError):
    """Another process holds the bundle's lock; the message names it (``holder``: who, one line)."""

    def __init__(self, holder: str) -> None:
        super().__init__(f"{holder}; try again when it ends, or pass --wait")
        self.holder = holder


@contextmanager
def bundle_lock(bundle_dir: str | os.PathLike, wait: float = 0.0, command: str | None = None) -> Iterator[None]:
    """Hold ``BUNDLE/.lock`` for the block; ``wait``: seconds to wait for another holder (0: refuse at
    once with `BundleBusy`); ``command``: what the record calls this process (default: its command
    line's first two words). A missing directory is not locked: opening the bundle will say why."""
    path = Path(bundle_dir) / LOCK
    fd = _acquire(path, command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:2]]), wait)
    try:
        yield
    finally:
        if fd is not None:
            _release(fd, path)


def _release(fd: int, path: Path) -> None:
    """Remove the lock file (unless `fedmvp-export --force` took its directory away) and unlock it."""
    if _is_current(fd, path):
        path.unlink(missing_ok=True)
    os.close(fd)


def _acquire(path: Path, command: str, wait: float) -> int | None:
    """The locked file's descriptor with this process's record written (None: not lockable here)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: bundle changes are not serialised
        return None
    deadline, waiting = time.monotonic() + wait, False
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:  # no directory (the caller says so), or one nothing here can change
            if err.errno in (errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS):
                return None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = f"{path}: bundle in use by {describe(_record(path))}"
            if time.monotonic() >= deadline:
                raise BundleBusy(holder) from None
            if not waiting:
                print(f"waiting: {holder}", file=sys.stderr, flush=True)
                waiting = True
            time.sleep(POLL_SECONDS)
            continue
        if _is_current(fd, path):
            break
        os.close(fd)  # removed, or its directory replaced, while we waited: lock the current file
    try:
        _write_record(fd, path, command)
    except BaseException:
        _release(fd, path)
        raise
    return fd


def _write_record(fd: int, path: Path, command: str) -> None:
    """Say so when the lock's last holder died holding it, then record this process as the holder."""
    stale = _parse(os.pread(fd, 4096, 0))
    if stale is not None:
        print(f"warning: {path}: taking over the lock of {describe(stale)}: that process is gone",
              file=sys.stderr, flush=True)
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "since": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "command": command}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode("utf-8"), 0)


def _is_current(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        here, held = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def _parse(data: bytes) -> dict | None:
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _record(path: Path) -> dict | None:
    """The holder's record; it may be a moment from being written (the holder has just locked)."""
    for _ in range(20):
        try:
            record = _parse(path.read_bytes())
        except OSError:
            record = None
        if record is not None:
            return record
        time.sleep(0.02)
    return None


def describe(record: dict | None) -> str:
    """"pid 12 on host h since T (command)": who holds, or held, a lock."""
    if record is None:
        return "another process (no readable record of it)"
    return (f"pid {record.get('pid')} on {record.get('host')} since {record.get('since')} "
            f"({record.get('command')})")
