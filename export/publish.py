"""Where a bundle directory is published: an existing one is replaced only when nothing is lost.

Why: `fedmvp-export --force` renames a finished bundle over ``OUT``, and ``OUT`` may be a
device's bundle: its ``personalised/`` LoRAs, a ``previous/`` bundle or a refresh under way
(``device_state``) go only with ``discard_device_state``, and a bundle an `edge-client train`,
refresh or rollback is changing (its bundle lock, ``edge_client.bundle_lock``) is not replaced
at all: the lock is held from the last check to the rename, so nothing can appear in between.
An `edge-client infer` reading ``OUT`` meanwhile reloads the whole new bundle when the directory
changes under it (``edge_client.infer``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from fedmvp_formats.atomic import replace_dir
from fedmvp_formats.bundle_manifest import MANIFEST, PERSONALISED, PREVIOUS, REFRESH_JOURNAL, REFRESH_SCRATCH

from edge_client.bundle import BundleError
from edge_client.bundle_lock import LOCK, BundleBusy, bundle_lock
from export.errors import ExportError

DEVICE_STATE = (PERSONALISED, PREVIOUS, REFRESH_JOURNAL, *REFRESH_SCRATCH)  # what `--force` must not delete silently


def device_state(out: Path) -> list[str]:
    """What a device made in an existing bundle directory: its personalised/ LoRAs (with their
    rollback history), the previous/ bundle a refresh kept, a refresh under way. Replacing the
    directory would delete them and nothing else holds a copy (other stray files just go)."""
    if not out.is_dir():
        return []
    return sorted(name + ("/" if (out / name).is_dir() else "") for name in DEVICE_STATE if (out / name).exists())


def check_out(out: Path, force: bool, discard_device_state: bool = False) -> list[str]:
    """Refuse an ``out`` that exists (unless ``force``), holds device state (unless
    ``discard_device_state``) or is in a device command's hands now (before the export's work,
    not after it; `publish` checks again); returns the device state that replacing ``out`` will delete."""
    state = _refusal(out, force, discard_device_state)
    with _bundle_locked(out):
        return state


def _refusal(out: Path, force: bool, discard_device_state: bool) -> list[str]:
    """`check_out` without looking at the lock (`publish` holds it)."""
    if out.exists() and not force:
        raise ExportError(f"{out}: already exists (pass --force to replace it)")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a directory")
    if out.is_dir() and not (out / MANIFEST).is_file() and any(p.name != LOCK for p in out.iterdir()):
        # --out pointing at the run itself, or at any folder of someone's, would be deleted whole
        raise ExportError(f"{out}: is not a bundle (no {MANIFEST}) and not empty; --force replaces only "
                          f"bundles: choose another --out")
    state = device_state(out)
    if state and not discard_device_state:
        raise ExportError(f"{out}: --force would delete device state ({', '.join(state)}); export to another "
                          f"--out, or pass --discard-device-state as well to delete it")
    return state


@contextmanager
def _bundle_locked(out: Path) -> Iterator[None]:
    """Hold an existing ``out``'s bundle lock: no `edge-client train`, refresh or rollback is changing
    it (one that is makes the export fail with one line naming it, and ``out`` stays as it was)."""
    with ExitStack() as held:
        try:
            held.enter_context(bundle_lock(out, command="fedmvp-export --force"))
        except BundleBusy as busy:
            again = (f"if that process is gone, remove {out / LOCK}, then run fedmvp-export --force again"
                     if busy.elsewhere else "run fedmvp-export --force again when it ends")
            raise ExportError(f"{busy.holder}; {out} was not replaced ({again})") from None
        except BundleError as err:  # its .lock is a link or not a file: nothing is written through it
            raise ExportError(str(err)) from None
        yield


def publish(tmp: Path, out: Path, force: bool, discard_device_state: bool = False) -> list[str]:
    """Rename the finished temp dir onto ``out`` (an old ``out`` goes only after that succeeded), under
    ``out``'s bundle lock; returns the device state that went with the old ``out``."""
    with _bundle_locked(out):
        discarded = _refusal(out, force, discard_device_state)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp made it private; a bundle is meant to be copied around
        for child in tmp.iterdir():
            child.chmod(0o666 & ~umask)
        replace_dir(tmp, out)
        return discarded
