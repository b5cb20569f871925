"""The refresh journal: a bundle changes by a list of renames that a crash cannot leave half done.

Why: a refresh (and its rollback) replaces several files and directories of a bundle, and no
single rename swaps them all. So every new file is first staged, complete and fsynced, in a
scratch directory inside the bundle; nothing the bundle lists has changed yet, and a crash
there leaves only scratch to delete. Then the journal (``refresh.json``, the commit point) is
written with the renames in order, and rewritten after each one. `recover` (run before every
refresh and rollback, and by whoever starts the device) finishes the list after a crash,
removes the journal, then the scratch: the bundle is then exactly the old or the new one.

A step is a rename ``src -> dst`` (paths relative to the bundle). Steps before ``done`` are
finished; the step at ``done`` may have been renamed just before a crash, so it runs only
while ``src`` still exists. A step whose ``src`` never existed (no personalisation, no older
previous bundle) is skipped. The journal's and the scratch directories' names are the bundle format's
(``fedmvp_formats.bundle_manifest``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from fedmvp_formats.atomic import TEMP_SUFFIX, fsync_dir, move, write_bytes
from fedmvp_formats.bundle_manifest import (JOURNAL_FORMAT, JOURNAL_VERSION, REFRESH_JOURNAL, REFRESH_NEW,
                                            REFRESH_PREVIOUS, REFRESH_SCRATCH)

from edge_client.bundle import BundleError


def start_scratch(root: Path) -> None:
    """Empty scratch directories for a new change (leftovers of a crash before a journal go)."""
    clean_scratch(root)
    for name in REFRESH_SCRATCH:
        (root / name).mkdir()


def clean_scratch(root: Path) -> None:
    """Remove every scratch directory and the journal's temp files (none of it is part of a bundle)."""
    for name in REFRESH_SCRATCH:
        if (root / name).is_symlink():  # planted: the link goes, what it points at stays (never written)
            (root / name).unlink()
        shutil.rmtree(root / name, ignore_errors=True)
    for temp in root.glob(f".{REFRESH_JOURNAL}.*{TEMP_SUFFIX}"):
        temp.unlink(missing_ok=True)


def commit(root: Path, kind: str, moves: list[tuple[str, str]], record: dict[str, Any]) -> None:
    """Write the journal (from here on the change will complete) and carry out its renames."""
    fsync_dir(root / REFRESH_NEW)
    fsync_dir(root / REFRESH_PREVIOUS)
    fsync_dir(root)
    journal = {"format": JOURNAL_FORMAT, "format_version": JOURNAL_VERSION, "kind": kind, **record,
               "moves": [[src, dst] for src, dst in moves], "done": 0}
    _write(root, journal)
    _finish(root, journal)


def recover(root: Path) -> str | None:
    """Finish an interrupted change ("refresh" or "restore", returned) or drop a staged one (None)."""
    path = root / REFRESH_JOURNAL
    if not path.exists():
        clean_scratch(root)
        return None
    journal = _read(path)
    _finish(root, journal)
    return str(journal["kind"])


def _read(path: Path) -> dict[str, Any]:
    """The journal, checked enough that its renames stay inside the bundle."""
    try:
        journal = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise BundleError(f"{path}: unreadable refresh journal ({' '.join(str(err).split())[:200]})") from None
    moves = journal.get("moves") if isinstance(journal, dict) else None
    if not isinstance(journal, dict) or journal.get("format") != JOURNAL_FORMAT or not isinstance(moves, list) \
            or not isinstance(journal.get("done"), int):
        raise BundleError(f"{path}: not a {JOURNAL_FORMAT} file")
    for step in moves:
        if not (isinstance(step, list) and len(step) == 2 and all(_inside(path.parent, p) for p in step)):
            raise BundleError(f"{path}: malformed step {step!r} (it leaves the bundle or passes through a link)")
    return journal


def _inside(root: Path, relative: Any) -> bool:
    """Whether ``relative`` names a path in the bundle reached through no symbolic link (a journal comes with
    the bundle, so a step through a linked directory would move files outside it)."""
    if not isinstance(relative, str) or not relative or Path(relative).is_absolute():
        return False
    parts = Path(relative).parts
    return ".." not in parts and not any((root.joinpath(*parts[:i])).is_symlink() for i in range(1, len(parts)))


def _finish(root: Path, journal: dict[str, Any]) -> None:
    """Carry out the renames from ``done`` on, then remove the journal and the scratch."""
    moves = journal["moves"]
    for index in range(journal["done"], len(moves)):
        src, dst = root / moves[index][0], root / moves[index][1]
        if src.exists():
            if dst.exists():
                raise BundleError(f"{root / REFRESH_JOURNAL}: step {index + 1} would overwrite {dst}; "
                                  f"the bundle was changed during a refresh, re-export it")
            move(src, dst)
        journal["done"] = index + 1
        _write(root, journal)
    (root / REFRESH_JOURNAL).unlink()
    fsync_dir(root)
    clean_scratch(root)


def _write(root: Path, journal: dict[str, Any]) -> None:
    write_bytes(root / REFRESH_JOURNAL, (json.dumps(journal, indent=2, sort_keys=True) + "\n").encode("utf-8"))
