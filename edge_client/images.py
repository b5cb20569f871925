"""Robust image reading for on-device inference.

Edge devices see whatever files users drop on them: phone photos with EXIF rotation,
16-bit scans, CMYK JPEGs, animated GIFs, half-copied files and the occasional
decompression bomb. Everything here turns those into one RGB `PIL.Image` or one
`ImageReadError` with a one-line message, so the CLI can report a bad file and go on.
"""

from __future__ import annotations

import glob
import os
import struct
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from fedmvp_formats.folder_walk import image_files, regular_file_problem
from fedmvp_formats.image_folder import IMAGE_EXTENSIONS as EXTENSIONS
from fedmvp_formats.shown import path_shown

# 100 MP is about 300 MB once decoded to RGB: bearable on a Jetson, and above most
# camera photos (108/200 MP phone sensors need a higher `max_pixels`). Pillow's own bomb guard (Image.MAX_IMAGE_PIXELS, ~89 MP warns,
# ~179 MP raises) still applies on top; we turn its error into ImageReadError too.
DEFAULT_MAX_PIXELS = 100_000_000

IMAGE_EXTENSIONS = frozenset(EXTENSIONS)  # the one list: fedmvp_formats.image_folder

_GLOB_CHARS = frozenset("*?[")


class ImageReadError(ValueError):
    """One unreadable input. `str(err)` is a single line: '<path>: <problem>'."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = Path(path)
        self.reason = " ".join(str(reason).split())  # one line, whatever Pillow said
        super().__init__(f"{path_shown(self.path)}: {self.reason}")  # a file name's newline or escape, escaped

    def __reduce__(self) -> tuple[type[ImageReadError], tuple[Path, str]]:
        # Survive pickling (e.g. when images are decoded in a worker process).
        return (type(self), (self.path, self.reason))


def load_image(path: str | os.PathLike[str], max_pixels: int | None = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Read `path` as an upright RGB image, or raise `ImageReadError`.

    The pixel count is checked from the header before any pixel data is decoded.
    EXIF orientation is applied (cameras store portrait shots as rotated landscape).
    Animated files yield their first frame. Alpha is dropped with a plain
    `.convert("RGB")` (not composited onto white), exactly as open_clip's
    `_convert_to_rgb` / `MaybeConvertMode` do, so the model sees what it saw in training.
    `max_pixels=None` disables our limit (Pillow's global limit still applies).
    """
    p = Path(path)
    try:
        size = p.stat().st_size
    except FileNotFoundError:
        raise ImageReadError(p, "no such file") from None
    except OSError as e:
        raise ImageReadError(p, f"cannot access file ({e.strerror or e})") from None
    special = regular_file_problem(p)  # a FIFO is refused from its stat: opening it waits for a writer forever
    if special is not None:
        raise ImageReadError(p, special)
    if size == 0:
        raise ImageReadError(p, "empty file")

    with warnings.catch_warnings():
        # Our explicit pixel check replaces Pillow's warning-level bomb guard, and
        # Pillow's "corrupt EXIF" style UserWarnings must not spam the CLI's output.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.")
        try:
            im = Image.open(p)
        except UnidentifiedImageError:
            raise ImageReadError(p, "not an image (unrecognised format)") from None
        except _DECODE_ERRORS as e:
            raise ImageReadError(p, _describe(e, "corrupt image header")) from None
        with im:
            w, h = im.size
            if w <= 0 or h <= 0:
                raise ImageReadError(p, f"invalid image size {w}x{h}")
            if max_pixels is not None and w * h > max_pixels:
                raise ImageReadError(p, f"too many pixels: {w}x{h} = {w * h} > limit {max_pixels}")
            try:
                if getattr(im, "is_animated", False):
                    im.seek(0)
                im.load()
            except _DECODE_ERRORS as e:
                raise ImageReadError(p, _describe(e, "corrupt image data")) from None
            out = _upright(im)
            try:
                out = to_rgb(out)
            except (ValueError, OSError) as e:
                raise ImageReadError(p, f"unsupported image mode {out.mode!r} ({e})") from None
            # Leaving `with im` destroys im's pixel core: never hand back im itself.
            return out.copy() if out is im else out


# Pillow plugins signal bad data with any of these (struct.error from header parsing).
_DECODE_ERRORS = (
    Image.DecompressionBombError, OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error,
)


def _describe(e: BaseException, fallback: str) -> str:
    """Classify a Pillow exception as a bomb, a truncation or plain corruption."""
    msg = str(e) or type(e).__name__
    if isinstance(e, Image.DecompressionBombError):
        return f"too many pixels ({msg})"
    if "truncated" in msg.lower():
        return f"truncated image ({msg})"
    return f"{fallback} ({msg})"


def _upright(im: Image.Image) -> Image.Image:
    """Apply EXIF orientation; a malformed EXIF block must not cost us the image."""
    try:
        out = ImageOps.exif_transpose(im)
    except Exception:  # noqa: BLE001 - EXIF parsing failures are many and all harmless here
        return im
    return out if out is not None else im


def to_rgb(im: Image.Image) -> Image.Image:
    """Convert any Pillow mode to 8-bit RGB without clipping high-bit-depth data.

    Pillow's own `convert("L")` clips 16/32-bit and float values to 0..255, which turns
    most 16-bit scans white, so those modes are rescaled here first:
    I;16* -> value / 257; I -> as 16-bit when within 0..65535, else min-max;
    F -> x255 when within [0, 1], as-is within [0, 255], else min-max.
    Every other mode (L, LA, P, PA, 1, RGBA, CMYK, YCbCr, ...) uses plain `convert("RGB")`.
    """
    mode = im.mode
    if mode == "RGB":
        return im
    if mode.startswith("I;16") or mode == "I" or mode == "F":
        arr = np.asarray(im)
        return Image.fromarray(_to_uint8(arr, mode), mode="L").convert("RGB")
    return im.convert("RGB")


def _to_uint8(arr: np.ndarray, mode: str) -> np.ndarray:
    """Scale a single-channel high-bit-depth array to uint8 (see `to_rgb`)."""
    a = arr.astype(np.float64)
    if a.size == 0:
        return a.astype(np.uint8)
    finite = a[np.isfinite(a)]
    lo = float(finite.min()) if finite.size else 0.0
    hi = float(finite.max()) if finite.size else 0.0
    if mode.startswith("I;16") or (mode == "I" and lo >= 0 and hi <= 65535):
        scaled = a / 257.0
    elif mode == "F" and lo >= 0 and hi <= 1.0:
        scaled = a * 255.0
    elif mode == "F" and lo >= 0 and hi <= 255.0:
        scaled = a
    else:
        scaled = (a - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(a)
    scaled = np.nan_to_num(scaled, nan=0.0, posinf=255.0, neginf=0.0)
    return np.clip(np.rint(scaled), 0, 255).astype(np.uint8)


def is_image_path(path: Path) -> bool:
    """True for a non-hidden file name with a known image extension."""
    return path.suffix.lower() in IMAGE_EXTENSIONS and not path.name.startswith(".")


def printable(text: str) -> str:
    """``text`` as valid UTF-8: bytes a file name holds that are not UTF-8 (surrogate escapes from
    ``os.fsdecode``) become ``\\xNN``. Why: a JSON line or a table row with such a name would be
    invalid UTF-8, or crash the print."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that is no escaped byte
        raw = text.encode("utf-8", "backslashreplace")
    return raw.decode("utf-8", "backslashreplace")


def path_fields(path: str | os.PathLike) -> dict[str, str]:
    """``{"path": printable}`` plus ``"path_bytes"`` (hex of the raw name) when the name is not UTF-8,
    so a program reading the JSON can still find the file."""
    text = os.fspath(path)
    shown = printable(text)
    return {"path": shown} if shown == text else {"path": shown, "path_bytes": os.fsencode(text).hex()}


def iter_image_paths(
    inputs: list[str] | list[str | os.PathLike[str]],
    errors: list[ImageReadError] | None = None,
) -> list[Path]:
    """Expand files, directories and glob patterns into a de-duplicated list of paths.

    - a file is kept whatever its extension (the user named it; `load_image` judges it);
    - a directory is walked recursively, keeping image extensions only, sorted by
      relative path; hidden entries (e.g. macOS '._x.jpg' resource forks) are skipped;
    - a glob pattern (`*`, `?`, `[`; `**` recurses) keeps matched image files and
      expands matched directories.
    An input that is missing, matches nothing or holds no image is a problem: with
    `errors=None` the first one raises `ImageReadError`; given a list, each is appended
    there and the rest still expand, so a CLI can report per input and carry on.
    Input order is kept; a path reached twice is listed once.
    """
    out: list[Path] = []
    seen: set[str] = set()

    def add(p: Path) -> None:
        key = os.path.normcase(os.path.abspath(p))
        if key not in seen:
            seen.add(key)
            out.append(p)

    def problem(src: str, reason: str) -> None:
        err = ImageReadError(src, reason)
        if errors is None:
            raise err
        errors.append(err)

    for raw in inputs:
        text = os.path.expanduser(os.fspath(raw))
        p = Path(text)
        if p.is_dir():
            found = _walk_dir(p, problem)
            if not found:
                problem(text, "directory contains no image files")
            for f in found:
                add(f)
        elif p.exists():
            add(p)
        elif _GLOB_CHARS & set(text):
            matches = sorted(glob.glob(text, recursive=True))
            n_before = len(out)
            for m in matches:
                mp = Path(m)
                if mp.is_dir():
                    for f in _walk_dir(mp, problem):
                        add(f)
                elif mp.is_file() and is_image_path(mp):
                    add(mp)
            if len(out) == n_before and not matches:
                problem(text, "no files match this pattern")
            elif len(out) == n_before:
                problem(text, "pattern matches no image files")
        else:
            problem(text, "no such file or directory")
    return out


def _walk_dir(root: Path, problem: Callable[[str, str], None]) -> list[Path]:
    """Image files under `root` by the one walking rule (``fedmvp_formats.folder_walk``: no loop, nothing
    twice, no FIFO opened; each refusal a ``problem``), sorted by relative path."""
    files, refusals = image_files(root)
    for path, why in refusals:
        problem(path, why)
    return sorted((Path(f) for f in files), key=lambda f: f.relative_to(root).as_posix())
