"""The bundle lock: one command at a time changes a bundle (train, refresh, rollback, export --force).

Why: two `edge-client train` on one bundle both started from the same active LoRA, so the
second discarded what the first had learnt; a refresh moved ``personalised/`` and the files
under a running train, whose update then belonged to neither bundle; `fedmvp-export --force`
replaced the directory a train was about to personalise. Each of these now holds
``BUNDLE/.lock`` for its whole read-modify-write: a second one is refused with one line
naming the holder (`BundleBusy`), or waits for it (``wait`` seconds, ``math.inf``: as long as
it takes). Inference takes no lock: it must keep working while a device trains (it reloads
instead when the directory is replaced under it, ``edge_client.infer``).

The lock is the project's one (``fedmvp_formats.holder_lock.HolderLock``): ``.lock`` holds the holder's
record (pid, host, since, command) and exists only while held, so the bundle's tree stays what the
exporter and a refresh wrote. A waiter that locked a file meanwhile removed, or left behind in a
directory `fedmvp-export --force` replaced, tries again on the current one. It is never written
through a link: a ``.lock`` that is a symbolic link (to any file of the device) or not a regular file
is refused in one line (`BundleError`, exit 2) and nothing is written. A record of a holder killed on
this device is taken over with a warning; one naming another host (a bundle on a shared file system)
is refused like a live holder unless the operator passes ``break_lock`` (``--break-lock``).

``personalised/state.json``'s own short lock (``lora_store.personalisation_lock``, the same lock
without a record: an flock of the directory) is another file, so holding both never deadlocks. A bundle directory this
process cannot write to is not locked: it cannot change the bundle either. Standard library only.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

from fedmvp_formats.holder_lock import BREAK_HINT, LOCK, HolderLock, LockBusy
from fedmvp_formats.nofollow import UnsafePath

from edge_client.bundle import BundleError

__all__ = ["LOCK", "BundleBusy", "bundle_lock"]
_UNLOCKABLE = (errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS)


class BundleBusy(BundleError):
    """Another process holds the bundle's lock; the message names it (``holder``: who, one line)."""

    def __init__(self, holder: str, elsewhere: bool = False) -> None:
        hint = f"{BREAK_HINT}, or pass --wait" if elsewhere else "try again when it ends, or pass --wait"
        super().__init__(f"{holder}; {hint}")
        self.holder, self.elsewhere = holder, elsewhere


class BundleLock(HolderLock):
    """``BUNDLE/.lock``, its refusals as the bundle's errors (`bundle_lock`)."""

    def unsafe(self, err: UnsafePath) -> Exception:
        return BundleError(str(err))

    def busy(self, busy: LockBusy) -> Exception:
        return BundleBusy(busy.line, busy.elsewhere)


def bundle_lock(bundle_dir: str | os.PathLike, wait: float = 0.0, command: str | None = None,
                break_lock: bool = False) -> BundleLock:
    """Hold ``BUNDLE/.lock`` for the block; ``wait``: seconds to wait for another holder (0: refuse at
    once with `BundleBusy`); ``command``: what the record calls this process (default: its command
    line's first two words); ``break_lock``: take over a lock whose record names another host. A
    missing directory, or one nothing here can change, is not locked: opening the bundle will say why."""
    return BundleLock(bundle_dir, command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:2]]), "bundle", wait,
                      break_lock, unlockable=lambda err: err.errno in _UNLOCKABLE)
