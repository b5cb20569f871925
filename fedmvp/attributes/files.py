"""Attribute files: ``{class: [phrases]}`` JSON, optionally with a ``"_meta"`` block.

The paper's files are plain ``{class: [10 phrases]}`` dicts and load as they are. Files
written by ``fedmvp attributes generate`` add one reserved top-level key, ``"_meta"``
(model, prompt version, dates), which loaders skip and which can never be a class name.
Classes are looked up by exact name, never by position, so a file with a different class
order or extra classes still gives the right row for each label.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from fedmvp import atomic

META_KEY = "_meta"
MAX_FILE_BYTES = 8 << 20  # ImageNet's 1000 classes x 10 phrases are ~0.5 MB; more is not an attribute file

PathLike = str | os.PathLike


class AttributeFileError(ValueError):
    """An attribute or class-list file that cannot be used; the message names the file."""


def _normalise(name: str) -> str:
    return " ".join(name.replace("_", " ").replace("-", " ").lower().split())


def read_attribute_file(path: PathLike) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """``(attributes, meta)`` exactly as stored (file order, no K check); meta is ``{}`` if absent."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise AttributeFileError(f"{path}: {size / 1e6:.1f} MB is too large for an attribute file "
                                     f"(at most {MAX_FILE_BYTES >> 20} MiB)")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise AttributeFileError(f"{path}: no such attribute file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise AttributeFileError(f"{path}: cannot read attribute file ({exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AttributeFileError(
            f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise AttributeFileError(
            f"{path}: expected a JSON object {{class: [phrases]}}, got a {type(data).__name__}")
    meta = data.pop(META_KEY, {})
    if not isinstance(meta, dict):
        raise AttributeFileError(f"{path}: {META_KEY!r} must be an object")
    bad = [c for c, v in data.items()
           if not isinstance(v, list) or not all(isinstance(p, str) for p in v)]
    if bad:
        raise AttributeFileError(
            f"{path}: {len(bad)} classes do not map to a list of strings: {', '.join(bad)}")
    return data, meta


def load_attributes(path: PathLike, class_names: list[str] | None = None,
                    k: int | None = 10) -> dict[str, list[str]]:
    """Phrases per class, for ``class_names`` in that order (or every class in file order).

    With ``k`` each class needs at least ``k`` non-empty phrases and gets its first ``k``;
    ``k=None`` returns them all. Every problem of one kind is reported in a single
    ``AttributeFileError`` (e.g. all missing classes at once), so one run shows the whole fix.
    """
    attrs, _ = read_attribute_file(path)
    names = list(attrs) if class_names is None else list(class_names)
    missing = [c for c in names if c not in attrs]
    if missing:
        by_norm = {_normalise(c): c for c in attrs}
        hints = [f"{c!r} (file has {by_norm[_normalise(c)]!r})" for c in missing
                 if _normalise(c) in by_norm]
        hint = f"; names differ only in case/spacing: {', '.join(hints)}" if hints else ""
        raise AttributeFileError(
            f"{path}: {len(missing)} of {len(names)} classes missing: "
            f"{', '.join(missing)}{hint}")
    empty = [c for c in names if any(not p.strip() for p in attrs[c])]
    if empty:
        raise AttributeFileError(f"{path}: empty phrases for classes: {', '.join(empty)}")
    if k is not None:
        short = [f"{c} ({len(attrs[c])})" for c in names if len(attrs[c]) < k]
        if short:
            raise AttributeFileError(
                f"{path}: classes with fewer than {k} phrases: {', '.join(short)}")
    return {c: [p.strip() for p in attrs[c]][:k] for c in names}


def save_attributes(path: PathLike, attrs: dict[str, list[str]],
                    meta: dict[str, Any] | None = None) -> Path:
    """Write ``{"_meta": meta, class: phrases...}`` atomically (``fedmvp.atomic``).

    A crash or Ctrl-C mid-write leaves the previous file intact, which is what lets an
    interrupted generation resume from what it already had.
    """
    path = Path(path)
    if META_KEY in attrs:
        raise ValueError(f"{META_KEY!r} is reserved for metadata and cannot be a class name")
    payload: dict[str, Any] = {META_KEY: dict(meta)} if meta else {}
    payload.update((c, list(p)) for c, p in attrs.items())
    text = json.dumps(payload, indent=2, ensure_ascii=False) + "\n"
    atomic.write_text(path, text)
    return path


def read_class_names(path: PathLike) -> list[str]:
    """Class names from a JSON list or a text file (one per line, blanks and ``#`` comments skipped)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise AttributeFileError(f"{path}: no such class list") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise AttributeFileError(f"{path}: cannot read class list ({exc})") from None
    if text.lstrip().startswith("["):
        try:
            names = json.loads(text)
        except json.JSONDecodeError as exc:
            raise AttributeFileError(f"{path}: not a valid JSON list (line {exc.lineno}: "
                                     f"{exc.msg})") from None
        if not all(isinstance(n, str) and n.strip() for n in names):
            raise AttributeFileError(f"{path}: the JSON list must hold non-empty strings")
        names = [n.strip() for n in names]
    else:
        names = [ln.strip() for ln in text.splitlines()]
        names = [n for n in names if n and not n.startswith("#")]
    if not names:
        raise AttributeFileError(f"{path}: no class names")
    dupes = sorted(n for n, count in Counter(names).items() if count > 1)
    if dupes:
        raise AttributeFileError(f"{path}: duplicate class names: {', '.join(dupes)}")
    if META_KEY in names:
        raise AttributeFileError(f"{path}: {META_KEY!r} is reserved and cannot be a class name")
    return names
