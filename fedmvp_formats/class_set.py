"""The class-set digest: the one identity of a run's classes and their attribute phrases.

Why: a site's labels are indices into the run's class list, and its text side is built from each
class's phrases. A site whose attribute file lists other classes, the same ones in another order,
or other phrases, trains something else under the same names, and its reply would be averaged in.
So the run records this digest (RUN/classes.json), every train and evaluate message carries it with
the names, one digest per class's phrases and the phrases themselves (the ``class-set`` record,
``fedmvp_formats.messages``), a bundle's manifest and its update files carry it, and each reader
compares before it uses anything (docs/architecture.md "Records that travel"; docs/security.md).
The phrases travel so that a site may take the run's class set from the server instead of holding a
copy of its attribute file (`fedmvp join --classes-from-server`); a reader recomputes each class's
phrases digest from the phrases it received and the whole digest from those, so what it uses is what
the digest names.

Definition: sha256 over the canonical JSON (sorted keys none, ``","`` / ``":"`` separators, UTF-8) of
``[[name, phrases_digest], ...]`` in the set's order, where ``phrases_digest`` is the sha256 of the
canonical JSON list of that class's phrases. Defined over per-class digests so that a reader that
receives only names and per-class digests (an older sender's message, a bundle) can recompute the whole
digest and say which class differs; the phrases added to the record change nothing of the digest.

The record's values are ConfigRecord values (a str, lists of str or int: no nested list), so the
phrases travel flat, ``texts`` every class's phrases one after another in the set's order and ``counts``
how many are each class's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fedmvp_formats.shown import name_shown

DIGEST, NAMES, PHRASES = "digest", "names", "phrases"  # the class-set record's keys (messages.CLASS_SET)
TEXTS, COUNTS = "texts", "counts"  # the phrases themselves, flat, and how many are each class's
MAX_CLASSES = 100_000
MAX_NAME_CHARS = 1000  # a class name (a site's folder name is at most 255 bytes on most file systems)
MAX_PHRASES = 1000  # one class's phrases (K is 10 in the paper)
MAX_PHRASE_CHARS = 1000  # one phrase (CLIP reads 77 tokens; fedmvp.attributes.files' bound)
MAX_TEXT_CHARS = 8 << 20  # every name and phrase together (an attribute file is refused past 8 MiB)


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
    # each class's phrases, where known (a record without them: None); checked against ``phrases`` when
    # read, so the set's identity stays its names and digests alone
    texts: tuple[tuple[str, ...], ...] | None = field(default=None, compare=False)

    @classmethod
    def of(cls, classes: Sequence[tuple[str, Sequence[str]]]) -> ClassSet:
        """From ``(name, phrases)`` pairs in the set's order."""
        texts = tuple(tuple(str(p) for p in phrases) for _, phrases in classes)
        return cls(tuple(str(n) for n, _ in classes), tuple(phrases_digest(p) for p in texts), texts)

    @property
    def short(self) -> str:
        """The digest's short form, as a line shows it."""
        return self.digest[:12]

    @property
    def digest(self) -> str:
        return hashlib.sha256(_canonical([[n, p] for n, p in zip(self.names, self.phrases)])).hexdigest()

    def record(self) -> dict[str, Any]:
        """The message's ``class-set`` record (ConfigRecord values: a str, lists of str, a list of int), the
        phrases themselves included where known."""
        out: dict[str, Any] = {DIGEST: self.digest, NAMES: list(self.names), PHRASES: list(self.phrases)}
        if self.texts is not None:
            out |= {TEXTS: [p for phrases in self.texts for p in phrases], COUNTS: [len(p) for p in self.texts]}
        return out

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


def read_class_set(record: Any, with_texts: bool = False) -> ClassSet:
    """A received ``class-set`` record, checked: names unique non-empty strings of at most
    ``MAX_NAME_CHARS``, one 64-hex phrases digest each, the phrases (where sent; required ``with_texts``)
    strings of at most ``MAX_PHRASE_CHARS``, each class's the ones its digest names, every count bounded,
    and the record's digest the one its parts give (else ValueError, one line)."""
    if not isinstance(record, dict):
        raise ValueError("the class-set record is not a mapping")
    names, phrases, digest = record.get(NAMES), record.get(PHRASES), record.get(DIGEST)
    if not isinstance(names, list) or not names or len(names) > MAX_CLASSES \
            or not all(isinstance(n, str) and 0 < len(n) <= MAX_NAME_CHARS for n in names) \
            or len(set(names)) != len(names):
        raise ValueError(f"the class-set record's names are not a list of 1 to {MAX_CLASSES} unique class names "
                         f"of at most {MAX_NAME_CHARS} characters")
    if not isinstance(phrases, list) or len(phrases) != len(names) or not all(_is_sha256(p) for p in phrases):
        raise ValueError("the class-set record's phrases are not one sha256 per class")
    got = ClassSet(tuple(names), tuple(phrases), _texts(record, names, phrases, with_texts))
    if digest != got.digest:
        raise ValueError("the class-set record's digest is not the digest of its classes")
    return got


def _texts(record: dict, names: list[str], phrases: list[str], required: bool) -> tuple[tuple[str, ...], ...] | None:
    """Each class's phrases from the record's flat ``texts`` and ``counts``, each class's checked against
    its phrases digest; None where the record has neither (and they are not ``required``)."""
    texts, counts = record.get(TEXTS), record.get(COUNTS)
    if texts is None and counts is None and not required:
        return None
    if texts is None or counts is None:
        raise ValueError("the class-set record carries no attribute phrases (texts and counts)")
    if not isinstance(counts, list) or len(counts) != len(names) \
            or not all(_is_int(c) and 0 <= c <= MAX_PHRASES for c in counts):
        raise ValueError(f"the class-set record's counts are not one count of 0 to {MAX_PHRASES} phrases per class")
    if not isinstance(texts, list) or len(texts) != sum(counts) \
            or not all(isinstance(t, str) and len(t) <= MAX_PHRASE_CHARS for t in texts):
        raise ValueError(f"the class-set record's texts are not {sum(counts)} phrases of at most "
                         f"{MAX_PHRASE_CHARS} characters")
    if sum(map(len, texts)) + sum(map(len, names)) > MAX_TEXT_CHARS:
        raise ValueError(f"the class-set record's names and phrases exceed {MAX_TEXT_CHARS} characters")
    out, start = [], 0
    for name, count, digest in zip(names, counts, phrases):
        out.append(tuple(texts[start:start + count]))
        start += count
        if phrases_digest(out[-1]) != digest:
            raise ValueError(f"the class-set record's phrases of class {name_shown(name)} are not the ones its "
                             f"digest names")
    return tuple(out)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= set("0123456789abcdef")
