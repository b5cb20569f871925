"""The synthetic attribute world: attribute vocabulary, named class compositions, phrases.

Why it exists: no pretrained CLIP and no public data set can be fetched offline, so fedmvp
ships a small world where attributes really decide the class. A class is a composition
(shape, colour, pattern, size) with a made-up one-word name ("zorblin") and a descriptive
name ("small red striped circle"). Held-out compositions are never captioned by name in
pretraining but share every attribute value with seen ones: they are the "new" classes.

The class list is data (``world_classes.json``); ``design_classes`` documents (and can
regenerate) how it was made.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import numpy as np

CLASSES_FILE = Path(__file__).with_name("world_classes.json")
# photo, sketch and painting are what the tiny CLIP was pretrained on; night and fog are not
# (downstream shifts, like a real dataset is for a real CLIP). Order fixes each domain's seed key.
DOMAINS: tuple[str, ...] = ("photo", "sketch", "painting", "night", "fog")
SPLITS: tuple[str, ...] = ("train", "val", "test")
K_PHRASES = 10

SHAPES: dict[str, tuple[str, str]] = {  # shape -> two LLM-style phrases
    "circle": ("a round circular outline", "a smooth curved edge with no corners"),
    "square": ("four equal straight sides", "four sharp corners at right angles"),
    "triangle": ("three straight sides", "three pointed corners"),
    "star": ("five pointed arms", "a spiky star outline"),
    "cross": ("four short arms like a plus sign", "two bars crossing in the middle"),
    "heart": ("two rounded lobes on top", "a pointed tip at the bottom like a heart"),
    "crescent": ("a thin curved body like a crescent moon", "two sharp horns at its ends"),
    "diamond": ("a tall stretched diamond outline", "four corners with two of them far apart"),
}
COLOURS: dict[str, tuple[tuple[int, int, int], tuple[str, str]]] = {  # colour -> (rgb, phrases)
    "red": ((222, 38, 38), ("a bright red colour", "a red tone like a ripe tomato")),
    "orange": ((246, 136, 20), ("a vivid orange colour", "an orange tone like a pumpkin")),
    "yellow": ((240, 216, 36), ("a bright yellow colour", "a yellow tone like a lemon")),
    "green": ((38, 166, 58), ("a green colour", "a green tone like fresh grass")),
    "cyan": ((40, 200, 216), ("a light cyan colour", "a cyan tone like clear tropical water")),
    "blue": ((36, 70, 214), ("a deep blue colour", "a blue tone like the ocean")),
    "purple": ((140, 48, 186), ("a purple colour", "a purple tone like a grape")),
    "pink": ((246, 122, 188), ("a soft pink colour", "a pink tone like candy floss")),
}
PATTERNS: dict[str, tuple[str, tuple[str, str]]] = {  # pattern -> (adjective, phrases)
    "solid": ("plain", ("a plain solid fill", "is evenly coloured with no markings")),
    "striped": ("striped", ("parallel stripes across its surface", "is covered in thin stripes")),
    "dotted": ("dotted", ("small round dots across its surface", "is covered in spots")),
    "checkered": ("checkered", ("a checkered pattern of small squares", "is covered in a grid like a chessboard")),
}
SIZES: dict[str, tuple[float, str]] = {  # size -> (radius as a fraction of the image, phrase)
    "small": (0.21, "is small in size"),
    "large": (0.33, "is large in size"),
}
PREFIX_WORDS = ("a photo of a", "a sketch of a", "a painting of a", "an object", "a shape", "which has",
                "which is", "which", "and")


@dataclass(frozen=True)
class WorldClass:
    """One class: a named attribute composition."""

    name: str  # made-up one-word name: folder name and attributes.json key
    shape: str
    colour: str
    pattern: str
    size: str
    held_out: bool

    @property
    def pattern_adjective(self) -> str:
        return PATTERNS[self.pattern][0]

    @property
    def description(self) -> str:
        """Descriptive name, e.g. 'small red striped circle'."""
        return f"{self.size} {self.colour} {self.pattern_adjective} {self.shape}"

    def values(self) -> dict[str, str]:
        return {"shape": self.shape, "colour": self.colour, "pattern": self.pattern, "size": self.size}


def article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def class_phrases(cls: WorldClass) -> list[str]:
    """The 10 attribute phrases, in the format an LLM returns (``{class: [10 phrases]}``)."""
    shape = SHAPES[cls.shape]
    colour = COLOURS[cls.colour][1]
    pattern = PATTERNS[cls.pattern][1]
    phrases = [shape[0], shape[1], colour[0], colour[1], pattern[0], pattern[1], SIZES[cls.size][1],
               f"{article(cls.colour)} {cls.colour} {cls.pattern_adjective} surface",
               f"{article(cls.colour)} {cls.colour} {cls.shape} shape",
               f"typically looks like a {cls.description}"]
    assert len(phrases) == K_PHRASES
    return phrases


# ---- class list ------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def load_classes() -> tuple[WorldClass, ...]:
    """All 64 classes in label order: 48 seen first, then 16 held-out."""
    data = json.loads(CLASSES_FILE.read_text())
    return tuple(WorldClass(**row) for row in data["classes"])


def seen_classes() -> list[WorldClass]:
    return [c for c in load_classes() if not c.held_out]


def held_out_classes() -> list[WorldClass]:
    return [c for c in load_classes() if c.held_out]


def attributes_dict(classes: tuple[WorldClass, ...] | list[WorldClass] | None = None) -> dict[str, list[str]]:
    """``{class name: [10 phrases]}`` in label order."""
    return {c.name: class_phrases(c) for c in (classes or load_classes())}


_ONSETS = ["b", "br", "d", "dr", "f", "fl", "g", "gl", "gr", "k", "kl", "l", "m", "n", "p", "pl", "qu", "r",
           "s", "sn", "sp", "t", "tr", "v", "w", "z", "zh", "j"]
_VOWELS = ["a", "e", "i", "o", "u", "oo", "ai", "ee"]
_CODAS = ["b", "k", "l", "m", "n", "p", "r", "t", "x", "z", "sh", "ng"]
_ENDINGS = ["in", "et", "ix", "o", "er", "ik", "um", "on", "ee", "ap", "y", "ov"]


def made_up_words(count: int, seed: int, exclude: set[str] = frozenset()) -> list[str]:
    """Pronounceable nonsense words (deterministic for a seed), e.g. 'zorblin', 'quavet'."""
    rng = np.random.default_rng(seed)
    words: list[str] = []
    seen = set(exclude)
    while len(words) < count:
        word = (rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                + rng.choice(_ONSETS[:12]) + rng.choice(_ENDINGS))
        if word not in seen and 5 <= len(word) <= 9:
            seen.add(word)
            words.append(word)
    return words


def design_classes(seed: int = 2025) -> list[WorldClass]:
    """How world_classes.json was made (kept so the design is reviewable and reproducible).

    Eight groups of eight classes; group g pairs every shape s with colour (s + offset_g) % 8
    and one pattern. Offsets repeat across patterns, so some classes share shape and colour
    and differ only by pattern (patterns matter). Each group holds out shapes g and g + 4:
    16 held-out compositions: every shape and every colour twice, every pattern and size
    four / eight times, and every value also present among the seen.
    """
    shapes, colours, patterns = list(SHAPES), list(COLOURS), list(PATTERNS)
    offsets = [(0, 0), (0, 1), (1, 0), (1, 2), (2, 1), (2, 6), (3, 5), (3, 1)]  # (pattern, offset)
    rng = np.random.default_rng(seed)
    seen, held = [], []
    for g, (p, off) in enumerate(offsets):
        for s in range(8):
            size = list(SIZES)[(s + g // 2) % 2]
            row = dict(shape=shapes[s], colour=colours[(s + off) % 8], pattern=patterns[p], size=size)
            (held if s in (g % 8, (g + 4) % 8) else seen).append(row)
    order = rng.permutation(len(seen))
    seen = [seen[i] for i in order]
    held = [held[i] for i in rng.permutation(len(held))]
    names = made_up_words(len(seen) + len(held), seed)
    out = [WorldClass(name=n, held_out=False, **r) for n, r in zip(names, seen)]
    out += [WorldClass(name=n, held_out=True, **r) for n, r in zip(names[len(seen):], held)]
    return out


def write_classes_file(path: Path = CLASSES_FILE, seed: int = 2025) -> None:
    from fedmvp.atomic import write_text

    rows = [asdict(c) for c in design_classes(seed)]
    body = ",\n".join("    " + json.dumps(r) for r in rows)
    doc = ("Classes of the synthetic world in label order (48 seen, then 16 held-out). "
           "Made by fedmvp.synthetic.world.design_classes(seed=%d)." % seed)
    write_text(path, '{\n  "_doc": %s,\n  "classes": [\n%s\n  ]\n}\n' % (json.dumps(doc), body))


def world_texts() -> Iterator[str]:
    """Every text of the world: what the compact tokenizer's vocabulary is cut from."""
    from fedmvp.attributes.sentences import TEMPLATES, SentenceStyle, build_sentences

    yield from TEMPLATES["domain_prefixes"].values()
    yield from PREFIX_WORDS
    yield " ".join(TEMPLATES["connectors"].values())
    classes = load_classes()
    attrs = attributes_dict()
    for domain in DOMAINS:
        style = SentenceStyle.for_domain(domain)
        yield from build_sentences([c.name for c in classes], attrs, style).flat()
        for c in classes:
            yield f"{style.prefix} {c.name}"
            yield f"{style.prefix} {c.description}"
    for values in (SHAPES, COLOURS, SIZES):
        yield " ".join(values)
    for adjective, phrases in PATTERNS.values():
        yield adjective
        yield from phrases
