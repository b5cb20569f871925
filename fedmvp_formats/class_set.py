"""The class-set digest: the one identity of a run's classes and their attribute phrases.

Why: a site's labels are indices into the run's class list, and its text side is built from each
class's phrases. A site whose attribute file lists other classes, the same ones in another order,
or other phrases, trains something else under the same names, and its reply would be averaged in.
So the run records this digest (RUN/classes.json), every train and evaluate message carries it with
the names and one digest per class's phrases (the ``class-set`` record, ``fedmvp_formats.messages``),
a bundle's manifest and its update files carry it, and each reader compares before it uses anything
(docs/architecture.md "Records that travel"; docs/security.md).

Definition: sha256 over the canonical JSON (sorted keys none, ``","`` / ``":"`` separators, UTF-8) of
``[[name, phrases_digest], ...]`` in the set's order, where ``phrases_digest`` is the sha256 of the
canonical JSON list of that class's phrases. Defined over per-class digests so that a reader that
receives only names and per-class digests (a message) can recompute the whole digest and say which
class differs, without the phrases themselves travelling.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedmvp_formats.shown import name_shown

DIGEST, NAMES, PHRASES = "digest", "names", "phrases"  # the class-set record's keys (messages.CLASS_SET)
MAX_CLASSES = 100_000


def _canonical(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def phrases_digest(phrases: Sequence[str]) -> str:
    """sha256 of one class's attribute phrases, in their order."""
    return hashlib.sha256(_canonical([str(p) for p in phrases])).hexdigest()


@dataclass(frozen=True)
class ClassSet:
    """A class set as it travels: names in the set's order and one phrases digest per class."""

    names: tuple[str, ...]
    phrases: tuple[str, ...]  # phrases_digest of each class, in the same order

    @classmethod
    def of(cls, classes: Sequence[tuple[str, Sequence[str]]]) -> ClassSet:
        """From ``(name, phrases)`` pairs in the set's order."""
        return cls(tuple(str(n) for n, _ in classes), tuple(phrases_digest(p) for _, p in classes))

    @property
    def digest(self) -> str:
        return hashlib.sha256(_canonical([[n, p] for n, p in zip(self.names, self.phrases)])).hexdigest()

    def record(self) -> dict[str, Any]:
        """The message's ``class-set`` record (ConfigRecord values: a str and two lists of str)."""
        return {DIGEST: self.digest, NAMES: list(self.names), PHRASES: list(self.phrases)}

    def difference(self, run: ClassSet) -> str | None:
        """What differs from ``run`` (the run's set), in one phrase naming the first differing class;
        None when the digests agree."""
        if self.digest == run.digest:
            return None
        ours, theirs = set(self.names), set(run.names)
        if ours != theirs:
            missing = [n for n in run.names if n not in ours]
            extra = [n for n in self.names if n not in theirs]
            parts = ([f"lacks the run's class {name_shown(missing[0])}" + _more(missing)] if missing else []) + \
                    ([f"has class {name_shown(extra[0])} the run has not" + _more(extra)] if extra else [])
            return f"other classes ({'; '.join(parts)})"
        if self.names != run.names:
            i = next(i for i, (a, b) in enumerate(zip(self.names, run.names)) if a != b)
            return (f"other class order (class {i} is {name_shown(self.names[i])} here, "
                    f"{name_shown(run.names[i])} in the run)")
        changed = [n for n, a, b in zip(self.names, self.phrases, run.phrases) if a != b]
        return f"other attribute phrases (first for class {name_shown(changed[0])}{_more(changed)})"


def _more(items: list[str]) -> str:
    return f", and {len(items) - 1} more" if len(items) > 1 else ""


def class_set_digest(classes: Sequence[tuple[str, Sequence[str]]]) -> str:
    """The digest of ``(name, phrases)`` pairs in the set's order (`ClassSet.digest`)."""
    return ClassSet.of(classes).digest


def read_class_set(record: Any) -> ClassSet:
    """A received ``class-set`` record, checked: names unique non-empty strings, one 64-hex phrases digest
    each, and the record's digest the one its parts give (else ValueError, one line)."""
    if not isinstance(record, dict):
        raise ValueError("the class-set record is not a mapping")
    names, phrases, digest = record.get(NAMES), record.get(PHRASES), record.get(DIGEST)
    if not isinstance(names, list) or not names or len(names) > MAX_CLASSES \
            or not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise ValueError("the class-set record's names are not a list of unique class names")
    if not isinstance(phrases, list) or len(phrases) != len(names) or not all(_is_sha256(p) for p in phrases):
        raise ValueError("the class-set record's phrases are not one sha256 per class")
    got = ClassSet(tuple(names), tuple(phrases))
    if digest != got.digest:
        raise ValueError("the class-set record's digest is not the digest of its classes")
    return got


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= set("0123456789abcdef")
