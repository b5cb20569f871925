"""Where `edge-client train` may write: checked before training starts, so nothing is lost.

Why: ``--out BUNDLE/weights.safetensors`` once replaced a bundle's frozen weights with a 25 KB
update and reported success. An output path inside a bundle directory (any directory above it
holding a fedmvp bundle ``manifest.json``) or a run directory (`is_run_dir`: its config.json's marker)
is refused, an existing file is never overwritten (the command did not create it), and every
directory that will be written is probed (a file created and removed) so a read-only or
missing target is one line before minutes of training, not a traceback after. Standard library only.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from fedmvp_formats.bundle_manifest import FORMAT, MANIFEST
from fedmvp_formats.files import (ROUND_PREFIX, ROUND_STATE, RUN_CONFIG, RUN_FILES_BEFORE_FORMAT, RUN_FORMAT_KEY,
                                  JsonRecordError, is_run_format, nearest_existing, read_json_object)
from fedmvp_formats.files import probe_writable as probe_writable_folder


class WriteTargetError(ValueError):
    """A path this command must not (or cannot) write; one line naming it."""


def _json_object(path: Path) -> dict | None:
    """The JSON object in ``path`` (through a link: a link may lead into a bundle or a run), or None."""
    try:
        return read_json_object(path, follow_links=True)
    except JsonRecordError:
        return None


def is_run_dir(directory: Path) -> bool:
    """Whether ``directory`` is a fedmvp run: its config.json carries the run marker (``format``, written by
    ``fedmvp.runs.RunDir``), or, for a run made before the marker, it has a config.json and one of the files
    every such run wrote beside it (``fedmvp_formats.files``: preset.toml, classes.json, metrics.jsonl, a
    round-NNNN/state.json). Keys a config.json happens to hold prove nothing: any tool writes a config.json."""
    config = _json_object(directory / RUN_CONFIG)
    if config is None:
        return False
    if RUN_FORMAT_KEY in config:
        return is_run_format(config[RUN_FORMAT_KEY])
    return (any((directory / name).is_file() for name in RUN_FILES_BEFORE_FORMAT)
            or any((folder / ROUND_STATE).is_file() for folder in directory.glob(f"{ROUND_PREFIX}[0-9]*")))


def protected_owner(path: Path) -> tuple[Path, str] | None:
    """(directory, "bundle" | "run") of the first bundle or run directory at or above ``path``."""
    for directory in [path, *path.parents]:
        manifest = _json_object(directory / MANIFEST)
        if manifest is not None and manifest.get("format") == FORMAT:
            return directory, "bundle"
        if is_run_dir(directory):
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
