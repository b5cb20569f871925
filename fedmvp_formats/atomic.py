"""Atomic writes: the one way the project replaces a file or a folder a reader may look at.

A reader (inference, a server collecting updates, a second process) sees the old file or the
complete new one, never half of it, and a crash or full disk never loses a file that was reported
written. So: write a temp file in the target's folder (same file system, so the rename is atomic),
fsync it, give it the mode of the file it replaces (else what ``open(path, "w")`` would give: 0o666
less the umask, not ``mkstemp``'s 0o600) unless the caller names one, ``os.replace`` it over the
target and fsync the folder so the rename itself survives a power cut. Standard library only.

Never through a link (docs/security.md, "Links planted in a run or a bundle"): the temp file is created
with ``O_EXCL | O_NOFOLLOW`` (``mkstemp``) and written, fsynced and chmodded through the descriptor that
created it, and it must still be that file when it is renamed; the rename replaces a link at the target
(the link goes, what it pointed at is untouched), whose target's mode is not copied.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from fedmvp_formats.nofollow import UnsafePath, open_nofollow

TEMP_SUFFIX = ".tmp"  # temp files are ".<name>.<pid>.<random>.tmp" next to the target

PathLike = str | os.PathLike


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


def fsync_dir(directory: PathLike) -> None:
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


def umask() -> int:
    """The process umask (read by setting it and setting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def new_file_mode() -> int:
    """0o666 less the process umask: what ``open(path, "w")`` would have given the file."""
    return 0o666 & ~umask()


def _temp_beside(path: Path) -> tuple[int, Path]:
    """A new empty temp file beside ``path`` (its folder is created), named for `temp_is_removable`, and
    its descriptor: ``mkstemp`` opens with ``O_EXCL | O_NOFOLLOW``, so a link planted at the name is
    never followed (another random name is taken)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=TEMP_SUFFIX, dir=path.parent)
    return fd, Path(tmp)


def _mode_of(path: Path) -> int:
    """The mode a replacement of ``path`` gets: that of the regular file it replaces (not a link's target's)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return new_file_mode()
    return info.st_mode & 0o777 if stat.S_ISREG(info.st_mode) else new_file_mode()


def _commit(fd: int, tmp: Path, path: Path, mode: int | None) -> None:
    """fsync the temp file ``fd``, give it its mode, rename it over ``path``, fsync the folder; ``tmp``
    goes on error. A temp name that no longer names ``fd``'s file (replaced meanwhile) is refused."""
    try:
        os.fsync(fd)
        os.fchmod(fd, mode if mode is not None else _mode_of(path))
        here, held = os.lstat(tmp), os.fstat(fd)
        if (here.st_dev, here.st_ino) != (held.st_dev, held.st_ino):
            raise UnsafePath(tmp, "replaced while it was written (not the temp file this process created)")
        os.replace(tmp, path)
    except BaseException:
        _discard(tmp, fd)
        raise
    os.close(fd)
    fsync_dir(path.parent)


def _discard(tmp: Path, fd: int) -> None:
    """Remove a temp file (only while its name is still the file this process created) and close it."""
    try:
        if os.path.samestat(os.lstat(tmp), os.fstat(fd)):
            tmp.unlink()
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: PathLike, mode: int | None = None) -> Iterator[Path]:
    """Yield a temp path beside ``path`` for a writer that wants a file name (a library's ``save``);
    on success it replaces ``path``, on error it is removed."""
    path = Path(path)
    fd, tmp = _temp_beside(path)
    os.close(fd)  # the library opens the name itself (some write a new file and rename it there)
    try:
        yield tmp
        fd = open_nofollow(tmp, os.O_RDONLY)  # what it left: a regular file, not a link
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _commit(fd, tmp, path, mode)


@contextmanager
def replacing(path: PathLike, mode: int | None = None) -> Iterator[BinaryIO]:
    """A binary handle on a temp file that replaces ``path`` when the block ends without error (written
    through the descriptor that created it, never reopened by name)."""
    path = Path(path)
    fd, tmp = _temp_beside(path)
    try:
        with os.fdopen(fd, "wb", closefd=False) as handle:
            yield handle
    except BaseException:
        _discard(tmp, fd)
        raise
    _commit(fd, tmp, path, mode)


def write_bytes(path: PathLike, data: bytes, mode: int | None = None) -> Path:
    """Replace ``path`` with ``data`` atomically (parent folders are created); ``mode``: e.g. 0o600 for a key."""
    path = Path(path)
    with replacing(path, mode) as handle:
        handle.write(data)
    return path


def write_text(path: PathLike, text: str) -> Path:
    """`write_bytes` of UTF-8 text."""
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: PathLike, obj: Any) -> Path:
    """`write_text` of ``obj`` as indented JSON with a final newline; a number that is not finite is written
    as null (``fedmvp_formats.strict_json``: any strict parser reads the file)."""
    from fedmvp_formats.strict_json import dumps

    return write_text(path, dumps(obj, indent=2, sort_keys=False) + "\n")


def copy_file(source: PathLike, path: PathLike) -> Path:
    """Replace ``path`` with a byte-for-byte copy of ``source`` atomically (streamed, not read whole)."""
    path = Path(path)
    with open(source, "rb") as src, replacing(path) as handle:
        shutil.copyfileobj(src, handle)
    return path


def copy_patched(source: PathLike, path: PathLike, patches: Mapping[int, bytes]) -> Path:
    """Replace ``path`` with a copy of ``source`` whose bytes at each offset are overwritten.

    Why: a tensor rewritten where it lies keeps every other byte (a file header, offsets another
    file points at) exactly as it was. A patch must lie inside the file: nothing moves or grows."""
    path = Path(path)
    size = Path(source).stat().st_size
    for offset, data in patches.items():
        if offset < 0 or offset + len(data) > size:
            raise ValueError(f"{source}: a patch of {len(data)} bytes at {offset} leaves the file ({size} bytes)")
    with open(source, "rb") as src, replacing(path) as handle:
        shutil.copyfileobj(src, handle)
        for offset, data in sorted(patches.items()):
            handle.seek(offset)
            handle.write(data)
    return path


def move(source: PathLike, target: PathLike) -> Path:
    """Rename ``source`` (a file, a folder or a link) to ``target`` on the same file system, durably.

    One rename is the only change a crash cannot leave half done; the bundle refresh is built of them."""
    source, target = Path(source), Path(target)
    os.replace(source, target)
    fsync_dir(target.parent)
    if source.parent != target.parent:
        fsync_dir(source.parent)
    return target


def replace_dir(source: PathLike, target: PathLike) -> Path:
    """Rename the finished folder ``source`` onto ``target``; an existing ``target`` is moved aside first
    (``.name.old-<random>``), put back if the rename fails, and deleted after it succeeded. A reader sees
    the old folder, the new one, or (for an instant) none: never part of one."""
    source, target = Path(source), Path(target)
    fsync_dir(source)
    if not target.exists() and not target.is_symlink():
        return move(source, target)
    old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(target, old)
    try:
        move(source, target)
    except BaseException:
        os.replace(old, target)
        raise
    if old.is_symlink():
        old.unlink()  # a link at the target: the link goes, never what it points at
    shutil.rmtree(old, ignore_errors=True)
    return target


@contextmanager
def atomic_dir(path: PathLike) -> Iterator[Path]:
    """Yield an empty temp folder beside ``path`` to fill; on success it becomes ``path`` (`replace_dir`),
    on error it is removed. Leftovers of a killed process are hidden (``.name.*``) and never match
    ``path``'s name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent))
    os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes 0700; the result should look like any folder
    try:
        yield tmp
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
