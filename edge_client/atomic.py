"""Atomic file replacement: the one way edge_client writes a file a reader may look at.

A reader (inference, a server collecting updates, a second `edge-client` process) must see
either the old file or the complete new one, never half of it, and a crash must not lose a
file that was reported written. So: write a temp file in the target's directory (same file
system, so the rename is atomic), fsync it, give it the permissions an ordinary new file gets
(0o666 less the umask: ``mkstemp`` would leave 0o600), ``os.replace`` it over the target and
fsync the directory so the rename itself survives a power cut. Standard library only.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

TEMP_SUFFIX = ".tmp"  # temp files are ".<name>.<pid>.<random>.tmp" next to the target


def temp_is_removable(name: str) -> bool:
    """Whether a temp file (``.<name>.<pid>.<random>.tmp``) is this process's or a dead one's.

    Why: cleanup must never delete the temp file another process is writing (it once left a
    personalised LoRA whose bytes no longer matched its sha256). A name without a pid is left alone."""
    parts = name.split(".")
    if not name.endswith(TEMP_SUFFIX) or len(parts) < 4 or not parts[-3].isdigit():
        return False
    pid = int(parts[-3])
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, someone else's
        return False
    return False


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Replace ``path`` with ``data`` atomically (parent directories are created)."""
    path = Path(path)
    with _replacing(path) as handle:
        handle.write(data)
    return path


def copy_file(source: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Replace ``path`` with a byte-for-byte copy of ``source`` atomically (streamed, not read whole)."""
    path = Path(path)
    with _replacing(path) as handle, open(source, "rb") as src:
        shutil.copyfileobj(src, handle)
    return path


def copy_patched(source: str | os.PathLike, path: str | os.PathLike, patches: Mapping[int, bytes]) -> Path:
    """Replace ``path`` with a copy of ``source`` whose bytes at each offset are overwritten.

    Why: a tensor rewritten where it lies keeps every other byte (a file header, offsets another
    file points at) exactly as it was. A patch must lie inside the file: nothing moves or grows."""
    path = Path(path)
    size = Path(source).stat().st_size
    for offset, data in patches.items():
        if offset < 0 or offset + len(data) > size:
            raise ValueError(f"{source}: a patch of {len(data)} bytes at {offset} leaves the file ({size} bytes)")
    with _replacing(path) as handle, open(source, "rb") as src:
        shutil.copyfileobj(src, handle)
        for offset, data in sorted(patches.items()):
            handle.seek(offset)
            handle.write(data)
    return path


def move(source: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Rename ``source`` (a file or a directory) to ``target`` on the same file system, durably.

    One rename is the only change a crash cannot leave half done; the bundle refresh is built of them."""
    source, target = Path(source), Path(target)
    os.replace(source, target)
    fsync_dir(target.parent)
    if source.parent != target.parent:
        fsync_dir(source.parent)
    return target


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename durable (no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _new_file_mode() -> int:
    """0o666 less the process umask: what ``open(path, "w")`` would have given the file."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@contextmanager
def _replacing(path: Path) -> Iterator[BinaryIO]:
    """A binary handle on a temp file that replaces ``path`` when the block ends without error."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=TEMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, _new_file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
