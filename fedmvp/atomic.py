"""The training core's one atomic writer: temp file in the same folder, fsync, rename.

A crash, Ctrl-C or full disk never leaves half a file behind: readers see the old file or the
new one. Used for run directories (config, checkpoints, metrics, plot), attribute files, the
text-feature cache and the synthetic world's metadata. ``atomic_dir`` does the same for a folder
of files (a checkpoint round: its tensors and its state.json appear together or not at all).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # platforms without directory handles
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp path beside ``path``; on success it replaces ``path``, on error it is removed.

    The result keeps the mode of the file it replaces (else the umask's default for new files)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~umask
    try:
        yield Path(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)  # mkstemp makes 0600; the result should look like any written file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield an empty temp folder beside ``path`` to fill; on success it becomes ``path`` in one
    rename, on error it is removed. An existing ``path`` is moved aside first and then deleted, so a
    reader sees the old folder, the new one, or (for an instant, when replacing) none: never part of one.
    Leftovers of a killed process are hidden (``.name.*``) and never match ``path``'s name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; the result should look like any folder
    try:
        yield tmp
        _fsync_dir(tmp)
        old = path.parent / f".{path.name}.{uuid.uuid4().hex}.old"
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | Path, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def save_safetensors(tensors: dict[str, Any], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """torch tensors to a safetensors file."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata=metadata)


def probe_writable(folder: str | Path) -> None:
    """Create ``folder`` and a probe file in it, then remove the probe: a read-only or full disk stops
    the work before it starts (OSError naming the path), not after an hour of rounds."""
    folder = Path(folder)
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():  # mkdir would only say "File exists"
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory (a file is in the way)", str(existing))
    folder.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=".probe.", dir=folder)
    try:
        os.write(fd, b"0" * 4096)
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(probe)


def os_error_line(err: OSError) -> str:
    """An OSError (EACCES, EROFS, ENOSPC, ...) as one line that names the path first."""
    where = err.filename if err.filename is not None else "error"
    return f"{where}: {err.strerror or err}"
