"""Writing inside a run or a bundle without following a link: the one way a file there is opened in place.

Why: a run directory and a bundle are copied between machines and users, so a name inside one may be a
symbolic link (or a hard link) planted to another file of the host. A writer that opens such a name in
place (a lock's record, a temp file) and truncates it writes outside the run or the bundle, which
docs/security.md says cannot happen. So every such open adds ``O_NOFOLLOW`` (a link is refused by the
kernel, not by a check a rename could race), and a file opened in place must be a regular file with one
name: anything else is refused in one line naming it, before a byte is written. A directory the product
writes into (``round-NNNN/``, ``personalised/``) is refused when it is a link (`refuse_linked_dir`).
Standard library only.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import IO

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # POSIX; elsewhere links are not created by unprivileged users
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO planted at the name must not hang the open


class UnsafePath(OSError):
    """A name inside a run or a bundle that is a link, or not a regular file, where the product writes;
    ``str()`` is the one line to show (it names the file)."""

    def __init__(self, path: str | os.PathLike, problem: str) -> None:
        super().__init__(errno.ELOOP, problem, os.fspath(path))
        self.line = f"{path_shown(path)}: {problem}; nothing was written through it (remove it and try again)"

    def __str__(self) -> str:
        return self.line


def path_shown(path: str | os.PathLike) -> str:
    """A path as an error line shows it: as is when printable, else escaped (``repr``)."""
    text = os.fspath(path)
    return text if text.isprintable() else repr(text)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def open_nofollow(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """``os.open`` for writing a name inside a run or a bundle: never through a link, and only a regular
    file with one name (a hard link to a file elsewhere is refused too). Returns the descriptor
    (close-on-exec); raises `UnsafePath` naming the file, or the OSError of the open."""
    try:
        fd = os.open(path, flags | NOFOLLOW | CLOEXEC | NONBLOCK, mode)
    except OSError as err:
        if err.errno == errno.ELOOP or (err.errno in (errno.EISDIR, errno.ENXIO, errno.EEXIST)
                                        and os.path.islink(path)):
            raise UnsafePath(path, f"a symbolic link (to {path_shown(os.readlink(path))})"
                             if os.path.islink(path) else "a symbolic link") from None
        if err.errno in (errno.EISDIR, errno.ENXIO):
            raise UnsafePath(path, "not a regular file") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafePath(path, _kind(info.st_mode))
        if info.st_nlink != 1:
            raise UnsafePath(path, f"a file with {info.st_nlink} names (a hard link to a file elsewhere)")
        if NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def append_nofollow(path: str | os.PathLike, mode: int = 0o644) -> IO[str]:
    """A text stream appending to a log at ``path`` (created when absent), opened by `open_nofollow`:
    a link or a second name planted there is refused (`UnsafePath`), never written through."""
    fd = open_nofollow(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, mode)
    return os.fdopen(fd, "a", encoding="utf-8", errors="replace")


def create_exclusive(path: str | os.PathLike, mode: int = 0o644) -> int:
    """A new, empty file at ``path`` opened for writing (``O_EXCL``: never an existing file or a link's
    target); FileExistsError when the name is taken (a caller picking random names tries another)."""
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, mode)


def read_nofollow(path: str | os.PathLike, limit: int = 1 << 16, follow_links: bool = False) -> bytes:
    """At most ``limit`` bytes of a small record file, never from a FIFO or a device (opened without
    blocking, refused from its ``fstat``), nor through a link unless ``follow_links`` (a file the operator
    names, such as a key, may be a link); OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | (0 if follow_links else NOFOLLOW) | CLOEXEC | NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafePath(path, "not a regular file")
        return os.pread(fd, limit, 0)
    finally:
        os.close(fd)


def refuse_linked_dir(path: str | os.PathLike) -> Path:
    """``path`` when it is a directory reached without a link, or absent (it will be created there);
    `UnsafePath` when it is a link (writes through it would land outside) or a file in the way."""
    path = Path(path)
    if path.is_symlink():
        raise UnsafePath(path, f"a symbolic link (to {path_shown(os.readlink(path))}) where a directory is written")
    if path.exists() and not path.is_dir():
        raise UnsafePath(path, "not a directory")
    return path
