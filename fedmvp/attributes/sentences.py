"""Attribute phrases -> CLIP sentences (docs/method.md §2).

``"{prefix} {class}, {suffix}{connector} {phrase}"``: "a photo of a giraffe, which has
exceptionally long neck". The connector drops "has" when the phrase starts with a
verb-like word ("which is striped", "which often ..."). Templates are data
(templates.json). Classes are indexed explicitly by label, never by file order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

TEMPLATES = json.loads((Path(__file__).with_name("templates.json")).read_text())


@dataclass(frozen=True)
class SentenceStyle:
    """How sentences are phrased for one dataset/domain."""

    prefix: str = TEMPLATES["default_prefix"]
    suffix: str = ""  # e.g. "a type of flower, "

    @classmethod
    def for_domain(cls, domain: str | None = None, dataset: str | None = None) -> "SentenceStyle":
        prefix = TEMPLATES["domain_prefixes"].get(domain or "", TEMPLATES["default_prefix"])
        suffix = TEMPLATES["dataset_suffixes"].get(dataset or "", "")
        return cls(prefix=prefix, suffix=suffix)


def connector_for(phrase: str) -> str:
    """'which has' unless the phrase starts with a verb-like word (then 'which' / 'which is')."""
    first = phrase.strip().split(" ", 1)[0].lower() if phrase.strip() else ""
    connectors = TEMPLATES["connectors"]
    return connectors.get(first, connectors["default"])


def class_display_name(name: str) -> str:
    """Folder-style names ('red_circle') read as words in sentences."""
    return name.replace("_", " ").strip()


def sentence(class_name: str, phrase: str, style: SentenceStyle = SentenceStyle()) -> str:
    phrase = phrase.strip().rstrip(".")
    return f"{style.prefix} {class_display_name(class_name)}, {style.suffix}{connector_for(phrase)} {phrase}"


@dataclass
class ClassSentences:
    """The [C, K] sentence grid for an ordered class set (row c = label c)."""

    class_names: list[str]
    sentences: list[list[str]] = field(default_factory=list)

    @property
    def k(self) -> int:
        return len(self.sentences[0]) if self.sentences else 0

    def flat(self) -> list[str]:
        return [s for row in self.sentences for s in row]


def build_sentences(class_names: list[str], attributes: dict[str, list[str]],
                    style: SentenceStyle = SentenceStyle(), k: int | None = None) -> ClassSentences:
    """Sentences for ``class_names`` in label order; every class needs the same number K of phrases."""
    missing = [c for c in class_names if c not in attributes]
    if missing:
        raise KeyError(f"no attributes for {len(missing)} classes: {', '.join(missing)}")
    counts = {len(attributes[c]) for c in class_names}
    k = k or min(counts)
    short = [c for c in class_names if len(attributes[c]) < k]
    if short:
        raise ValueError(f"classes with fewer than {k} attribute phrases: {', '.join(short)}")
    rows = [[sentence(c, p, style) for p in attributes[c][:k]] for c in class_names]
    return ClassSentences(class_names=list(class_names), sentences=rows)
