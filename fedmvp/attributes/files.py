"""Attribute files: ``{class: [phrases]}`` JSON, optionally with a ``"_meta"`` block.

The paper's files are plain ``{class: [10 phrases]}`` dicts and load as they are. Files
written by ``fedmvp attributes generate`` add one reserved top-level key, ``"_meta"``
(model, prompt version, dates), which loaders skip and which can never be a class name.
Classes are looked up by exact name, never by position, so a file with a different class
order or extra classes still gives the right row for each label.

A file is untrusted (a paper's download, a colleague's, an LLM's): it is refused with one line
when it is over ``MAX_FILE_BYTES`` (before it is read), nested past what the JSON parser can
take, holds a phrase over ``MAX_STORED_PHRASE_CHARS`` or anything but strings as phrases; class
names it holds appear in messages escaped and only the first few (``shown``, ``listed``).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from fedmvp import atomic
from fedmvp.attributes.prompt import listed, shown

META_KEY = "_meta"
MAX_FILE_BYTES = 8 << 20  # ImageNet's 1000 classes x 10 phrases are ~0.5 MB; more is not an attribute file
MAX_STORED_PHRASE_CHARS = 1000  # CLIP reads 77 tokens; a longer "phrase" is not one (LLM answers: prompt.py's 80)

PathLike = str | os.PathLike


class AttributeFileError(ValueError):
    """An attribute or class-list file that cannot be used; the message names the file."""


def _normalise(name: str) -> str:
    return " ".join(name.replace("_", " ").replace("-", " ").lower().split())


def read_attribute_file(path: PathLike) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """``(attributes, meta)`` exactly as stored (file order, no K check); meta is ``{}`` if absent."""
    path = Path(path)
    data = _parse_json(_read_text(path, "an attribute file"), path)
    if not isinstance(data, dict):
        raise AttributeFileError(
            f"{path}: expected a JSON object {{class: [phrases]}}, got a {type(data).__name__}")
    meta = data.pop(META_KEY, {})
    if not isinstance(meta, dict):
        raise AttributeFileError(f"{path}: {META_KEY!r} must be an object")
    for key in ("offline_classes", "runs"):
        value = meta.get(key, [])
        if not isinstance(value, list) or key == "offline_classes" and not all(isinstance(c, str) for c in value):
            raise AttributeFileError(f"{path}: {META_KEY!r} {key} must be a list"
                                     f"{' of class names' if key == 'offline_classes' else ''}")
    bad = [c for c, v in data.items()
           if not isinstance(v, list) or not all(isinstance(p, str) for p in v)]
    if bad:
        raise AttributeFileError(
            f"{path}: {len(bad)} classes do not map to a list of strings: {listed(bad)}")
    long = next(((c, p) for c, v in data.items() for p in v if len(p) > MAX_STORED_PHRASE_CHARS), None)
    if long:
        raise AttributeFileError(f"{path}: class {shown(long[0])} has a phrase of {len(long[1])} characters "
                                 f"(at most {MAX_STORED_PHRASE_CHARS})")
    return data, meta


def _read_text(path: Path, what: str) -> str:
    """A text file of at most ``MAX_FILE_BYTES`` (refused on its size before it is read)."""
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise AttributeFileError(f"{path}: {size / 1e6:.1f} MB is too large for {what} "
                                     f"(at most {MAX_FILE_BYTES >> 20} MiB)")
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise AttributeFileError(f"{path}: no such {what.split(' ', 1)[1]}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise AttributeFileError(f"{path}: cannot read {what.split(' ', 1)[1]} ({exc})") from None


def _parse_json(text: str, path: Path, what: str = "valid JSON") -> Any:
    """JSON or one line: Python's parser raises RecursionError past ~1000 nested lists or objects."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise AttributeFileError(f"{path}: not {what} (line {exc.lineno}, column {exc.colno}: "
                                 f"{exc.msg})") from None
    except RecursionError:
        raise AttributeFileError(f"{path}: not {what} (nested too deeply)") from None


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
        hints = [f"{shown(c, quote=True)} (file has {shown(by_norm[_normalise(c)], quote=True)})"
                 for c in missing if _normalise(c) in by_norm]
        hint = f"; names differ only in case/spacing: {', '.join(hints[:3])}" if hints else ""
        raise AttributeFileError(
            f"{path}: {len(missing)} of {len(names)} classes missing: "
            f"{listed(missing)}{hint}")
    empty = [c for c in names if any(not p.strip() for p in attrs[c])]
    if empty:
        raise AttributeFileError(f"{path}: empty phrases for classes: {listed(empty)}")
    if k is not None:
        short = [c for c in names if len(attrs[c]) < k]
        if short:
            raise AttributeFileError(f"{path}: classes with fewer than {k} phrases: "
                                     f"{listed([f'{c} ({len(attrs[c])})' for c in short])}")
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
    text = _read_text(path, "a class list")
    if text.lstrip().startswith("["):
        names = _parse_json(text, path, "a valid JSON list")
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
        raise AttributeFileError(f"{path}: duplicate class names: {listed(dupes)}")
    if META_KEY in names:
        raise AttributeFileError(f"{path}: {META_KEY!r} is reserved and cannot be a class name")
    return names
