"""The one rule for walking a user's folder of images: a site's folder, `fedmvp evaluate --data`, `fedmvp
join --data`, a device's `edge-client train --data` / `infer DIR` and the dataset layouts.

Why one rule in the leaf: every reader must list the same files, or a site's counts, its training and a
device's disagree; and each reader walking on its own is how a loop, a double count or a hanging open
came in (docs/security.md "A user's folder"). The rule (docs/howto/datasets.md "Links in a data folder"):

* hidden entries (``.name``) are skipped; files are kept by their image extension;
* a link that leads back into the folder walked (to it, to a folder above it, or to any place inside
  it) is refused: one line naming the link. Links that lead outside (a dataset kept elsewhere) are
  followed, under the same rule;
* nothing is listed twice: a directory or an image file reached a second time (a link loop outside the
  folder, a second link to the same place, a hard link) is refused, naming both paths;
* an image-named entry that is not a regular file (a FIFO, a socket, a device) is refused from its
  ``stat``, never opened (opening a FIFO waits forever for a writer).

Standard library only (the leaf); shown names are escaped (``shown.path_shown``).
"""

from __future__ import annotations

import os
import stat

from fedmvp_formats.image_folder import is_image_name
from fedmvp_formats.shown import path_shown

_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device"}


def special_kind(mode: int) -> str | None:
    """What a ``st_mode`` is when it is neither a regular file nor a directory (None when it is one)."""
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def regular_file_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` must not be opened as an image (a FIFO, a socket, a device, a directory), from its
    ``stat`` alone; None for a regular file, or when it cannot be stat'ed (opening it then says why)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISDIR(mode):
        return "is a directory, not an image file"
    kind = special_kind(mode)
    return None if kind is None else f"{kind}, not an image file: refused without opening it"


def within(path: str, folder: str) -> bool:
    """``path`` is ``folder`` or below it (both real paths)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


class FolderWalk:
    """Image files under folders of one ``root`` (the folder the user named), by the rule above.

    One walk per root, shared by its class folders, so an image reached from two classes is caught.
    ``refusals`` holds each refusal (path, why), ``problems`` it as lines; callers raise them."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = os.fspath(root)
        self.real_root = os.path.realpath(self.root)
        self.refusals: list[tuple[str, str]] = []  # (path, why): what the walk refused, in order
        self._dirs: dict[tuple[int, int], str] = {}
        self._files: dict[tuple[int, int], str] = {}

    @property
    def problems(self) -> list[str]:
        """One line per refusal: the path (escaped), then why."""
        return [f"{path_shown(path)}: {why}" for path, why in self.refusals]

    def images(self, folder: str | os.PathLike) -> list[str]:
        """Image files below ``folder`` (a folder of ``root``, or ``root``), recursively: each directory's
        files in name order, then its sub-directories in name order (os.walk's top-down order)."""
        folder = os.fspath(folder)
        if not self._enter(folder):
            return []
        found: list[str] = []
        stack = [folder]
        while stack:
            current = stack.pop()
            try:
                with os.scandir(current) as listing:
                    entries = sorted((e for e in listing if not e.name.startswith(".")), key=lambda e: e.name)
            except OSError as exc:
                self._refuse(current, f"cannot list the folder ({exc.strerror or exc})")
                continue
            subfolders = []
            for entry in entries:
                kind = self._kind(entry)
                if kind == "dir":
                    subfolders.append(entry.path)
                elif kind == "image":
                    found.append(entry.path)
            stack.extend(reversed(subfolders))
        return found

    def leads_back(self, path: str) -> str | None:
        """Where the link ``path`` leads when that is back into ``root`` (to it, above it or inside it)."""
        target = os.path.realpath(path)
        if within(target, self.real_root) or within(self.real_root, target):
            return target
        return None

    def _enter(self, folder: str) -> bool:
        """``folder`` is a directory not walked yet (a link to it obeys the link rule); else a problem."""
        if folder != self.root and os.path.islink(folder) and self._refused_link(folder):
            return False
        try:
            st = os.stat(folder)
        except OSError as exc:
            self._refuse(folder, f"cannot read the folder ({exc.strerror or exc})")
            return False
        if not stat.S_ISDIR(st.st_mode):
            self._refuse(folder, "not a directory")
            return False
        return self._first(self._dirs, st, folder, "folder")

    def _kind(self, entry: os.DirEntry) -> str | None:
        """``"dir"`` to walk, ``"image"`` to list, None to leave (problems noted)."""
        image = is_image_name(entry.name)
        try:
            if entry.is_symlink():
                if self._refused_link(entry.path):
                    return None
                st = os.stat(entry.path)
            elif entry.is_dir(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
            elif not image:
                return None  # never opened: not an image by its name
            else:
                st = entry.stat(follow_symlinks=False)
        except OSError as exc:
            if image:
                self._refuse(entry.path, f"cannot read it ({exc.strerror or exc}; "
                                     f"a broken link?)")
            return None
        if stat.S_ISDIR(st.st_mode):
            return "dir" if self._first(self._dirs, st, entry.path, "folder") else None
        if not image:
            return None
        if not stat.S_ISREG(st.st_mode):
            self._refuse(entry.path, f"{special_kind(st.st_mode)}, not an image file: "
                                 f"refused without opening it")
            return None
        return "image" if self._first(self._files, st, entry.path, "file") else None

    def _refuse(self, path: str, why: str) -> None:
        self.refusals.append((path, why))

    def _refused_link(self, path: str) -> bool:
        target = self.leads_back(path)
        if target is None:
            return False
        self._refuse(path, f"a link that leads back into {path_shown(self.root)} (to "
                             f"{path_shown(target)}): refused, each image is listed once; remove the link")
        return True

    def _first(self, seen: dict[tuple[int, int], str], st: os.stat_result, path: str, what: str) -> bool:
        """Whether ``st`` is met for the first time; the second time is a problem naming both paths."""
        key = (st.st_dev, st.st_ino)
        if key not in seen:
            seen[key] = path
            return True
        how = "a link loop or a second link to it" if what == "folder" else "a hard link or a second link to it"
        self._refuse(path, f"the same {what} as {path_shown(seen[key])} ({how}): refused, "
                             f"each image is listed once")
        return False


def image_files(folder: str | os.PathLike) -> tuple[list[str], list[tuple[str, str]]]:
    """(image files, refusals) of ``folder`` walked as its own root."""
    walk = FolderWalk(folder)
    return walk.images(folder), walk.refusals
