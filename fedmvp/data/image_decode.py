"""Images decoded as training decodes them, and a bad path reported once per process: no torch.

Why apart from `fedmvp.data.dataset`: a site's folder is checked (every image decoded) by `fedmvp join`'s
own process, which only checks and launches and imports no model library (docs/testing.md, "Where the
CPU goes"); the torch datasets that train on the same images build on these functions.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Callable, Iterable

from PIL import Image

from fedmvp_formats.folder_walk import regular_file_problem
from fedmvp_formats.shown import path_shown

Sample = tuple[str, int]
Transform = Callable[[Image.Image], Any]

_REPORTED: set[str] = set()
_LOCK = threading.Lock()


class UnreadableImageWarning(UserWarning):
    """An image file that cannot be decoded; it is skipped."""


def report_unreadable(path: str, error: BaseException | str) -> None:
    """Warn about ``path`` the first time only."""
    with _LOCK:
        if path in _REPORTED:
            return
        _REPORTED.add(path)
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    warnings.warn(f"skipping unreadable image {path_shown(path)}: {reason}", UnreadableImageWarning, stacklevel=3)


def decode_problem(path: str) -> str | None:
    """Why ``path`` does not decode as training decodes it (`load_rgb`, every pixel), or None.

    A full decode, not PIL's ``verify``: ``verify`` reads no JPEG data, so a truncated JPEG passed a
    check and was then dropped by training, and a site's counts disagreed with what it trained on."""
    try:
        load_rgb(path)
        return None
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError...
        return (str(exc).splitlines() or [""])[0] or type(exc).__name__


def is_readable(path: str) -> bool:
    """Whether ``path`` decodes in full as training decodes it (reports it once if not)."""
    problem = decode_problem(path)
    if problem is not None:
        report_unreadable(path, problem)
    return problem is None


def drop_unreadable(samples: Iterable[Sample]) -> list[Sample]:
    """``samples`` without the files that do not decode."""
    return [s for s in samples if is_readable(s[0])]


def load_rgb(path: str) -> Image.Image:
    """The image at ``path`` as RGB (palette, grey and RGBA images all become 3 channels); a FIFO or a
    device is refused from its ``stat``, never opened (an open would wait for a writer forever)."""
    problem = regular_file_problem(path)
    if problem is not None:
        raise OSError(problem)
    with Image.open(path) as img:
        return img.convert("RGB")
