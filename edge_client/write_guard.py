"""Where `edge-client train` may write: checked before training starts, so nothing is lost.

Why: ``--out BUNDLE/weights.safetensors`` once replaced a bundle's frozen weights with a 25 KB
update and reported success. An output path inside a bundle directory (any directory above it
holding a fedmvp bundle ``manifest.json``) or a run directory (holding a fedmvp ``config.json``)
is refused, an existing file is never overwritten (the command did not create it), and every
directory that will be written is probed (a file created and removed) so a read-only or
missing target is one line before minutes of training, not a traceback after. Standard library only.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from fedmvp_formats.bundle_manifest import FORMAT, MANIFEST
from fedmvp_formats.files import nearest_existing, probe_writable as probe_writable_folder

RUN_CONFIG = "config.json"


class WriteTargetError(ValueError):
    """A path this command must not (or cannot) write; one line naming it."""


def _json_object(path: Path) -> dict | None:
    """The JSON object in ``path``, or None (absent, unreadable, not an object)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def protected_owner(path: Path) -> tuple[Path, str] | None:
    """(directory, "bundle" | "run") of the first bundle or run directory at or above ``path``."""
    for directory in [path, *path.parents]:
        manifest = _json_object(directory / MANIFEST) if (directory / MANIFEST).is_file() else None
        if manifest is not None and manifest.get("format") == FORMAT:
            return directory, "bundle"
        config = _json_object(directory / RUN_CONFIG) if (directory / RUN_CONFIG).is_file() else None
        if config is not None and ("preset" in config or "model" in config or (directory / "rounds").is_dir()):
            return directory, "run"
    return None


def _candidates(target: Path) -> list[Path]:
    """The target's directory as typed and with every symlink resolved (a link may lead into a bundle)."""
    typed = Path(os.path.abspath(target.parent))
    return [typed, target.parent.resolve()]


def check_output_file(target: Path, allow_run_dir: bool = False) -> None:
    """Refuse a new output file inside a bundle or (unless ``allow_run_dir``) a run directory, or
    one that already exists."""
    for directory in _candidates(target):
        owner = protected_owner(directory)
        if owner is not None and not (allow_run_dir and owner[1] == "run"):
            place, kind = owner
            what = "a fedmvp bundle" if kind == "bundle" else "a fedmvp run directory"
            raise WriteTargetError(f"{target}: inside {what} ({place}); writing there could replace its files. "
                                   f"Choose --out outside it (default: ./updates)")
    if target.exists() or target.is_symlink():
        raise WriteTargetError(f"{target}: already exists; edge-client never overwrites a file it did not "
                               f"create (choose another --out, or a directory)")


def probe_writable(directory: Path, purpose: str) -> None:
    """Probe ``directory`` (or its nearest existing ancestor, for one not made yet): `WriteTargetError` if
    nothing can be written there."""
    try:
        probe_writable_folder(directory, create=False)
    except NotADirectoryError:
        raise WriteTargetError(f"{nearest_existing(directory)}: not a directory, cannot hold the {purpose}") from None
    except OSError as err:
        raise WriteTargetError(f"{nearest_existing(directory)}: cannot write the {purpose} here "
                               f"({err.strerror or errno.errorcode.get(err.errno, err)})") from None
