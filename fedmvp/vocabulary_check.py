"""Can the backbone tell the run's classes apart by text? Two figures, measured before training.

FedMVP classifies by the class text features (docs/method.md §2): a backbone whose text encoder gives
every class nearly the same feature sits near chance, whatever the prompts learn. The shipped tiny
CLIP knows only the words of its synthetic world; any other word falls into one of a few unknown
buckets (``fedmvp.tiny_tokenizer``), so real class names like "astronaut" or "horse" all read alike.
Nothing else says so: the run trains, and every figure sits at chance (docs/howto/weights.md).

- ``unknown_word_share``: the share of the distinct words of the class names and their attribute
  phrases that the tokenizer maps to unknown tokens (0 for open_clip's BPE, which has none), and
  ``unknown_name_share``, the same for the class names' words alone;
- ``text_similarity``: the mean pairwise cosine of the per-class text features the model uses
  (mean over a class's K attribute sentences, as ``FedMVP.class_weights``).

It warns, once, with the fix, when half the class names' words are unknown or the similarity is above
its threshold. Not on the share of all words: `fedmvp attributes generate --offline` writes the same
template words for every class ("typical", "distinctive"), unknown to the tiny CLIP and harmless there,
since they tell no class from another (the tutorial's synthetic classes: half their words unknown,
similarity -0.09).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedmvp import atomic
from fedmvp_formats.files import RUN_CONFIG

if TYPE_CHECKING:
    from fedmvp.clip import LoadedClip
    from fedmvp.presets.schema import Preset
    from fedmvp.run_classes import RunClass

RECORD_FILE = "vocabulary.json"
# Measured on fedmvp-tiny (docs/tutorials/one-machine.md "Your own class names on the tiny CLIP"): the
# demo's 40 classes: no unknown name, similarity 0.04 (its 16 held-out ones alone: 0.33); scikit-image's
# photo names (astronaut, camera, coffee, ...): every name unknown, similarity 0.92 with hand-written
# phrases, 0.97 with --offline ones, 0.997 with none. A real CLIP's text features of distinct classes sit
# in a narrow cone (cosines around 0.8), hence a similarity threshold well above that.
MAX_UNKNOWN_NAME_SHARE = 0.5
MAX_SIMILARITY = 0.95
_WORD = re.compile(r"[^\W_]+")


@dataclass(frozen=True)
class VocabularyCheck:
    """The two figures for one backbone and class set, and whether they warn."""

    clip: str
    classes: int
    unknown_word_share: float
    unknown_name_share: float
    text_similarity: float | None  # None: fewer than two classes
    unknown_words: tuple[str, ...]  # a few of them, for the record

    @property
    def warns(self) -> bool:
        return self.unknown_name_share >= MAX_UNKNOWN_NAME_SHARE or (
            self.text_similarity is not None and self.text_similarity > MAX_SIMILARITY)

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "unknown_words": list(self.unknown_words), "warns": self.warns,
                "thresholds": {"unknown_name_share": MAX_UNKNOWN_NAME_SHARE, "text_similarity": MAX_SIMILARITY}}

    def warning(self) -> str:
        """The one line a user reads (docs/tutorials/one-machine.md quotes it)."""
        sim = "n/a" if self.text_similarity is None else f"{self.text_similarity:.2f}"
        return (f"{self.clip} cannot tell these {self.classes} classes apart by text ({self.unknown_name_share:.0%} "
                f"of their names' words unknown to its tokenizer, class text similarity {sim}): every figure will sit near "
                f"chance; use a real CLIP by name or weights file ([model] clip = \"ViT-B-16\", pretrained = "
                f"\"openai\" or a file: docs/howto/weights.md)")


def words(texts: list[str]) -> list[str]:
    """Distinct lower-case words of ``texts``, in first-seen order."""
    return list(dict.fromkeys(w.lower() for t in texts for w in _WORD.findall(t)))


def measure(clip: LoadedClip, classes: list[RunClass]) -> VocabularyCheck:
    """Both figures for ``classes`` on ``clip`` (text features through the shared cache, which training reuses)."""
    import torch

    from fedmvp.attributes.cache import TextFeatureCache
    from fedmvp.attributes.sentences import class_display_name, sentence
    from fedmvp.tiny_tokenizer import CompactTokenizer

    names = words([class_display_name(c.name) for c in classes])
    every = words(names + [p for c in classes for p in c.phrases])
    tokenizer = clip.tokenizer
    compact = isinstance(tokenizer, CompactTokenizer)  # open_clip's BPE maps every word to its own pieces
    unknown = [w for w in every if compact and not tokenizer.is_known(w)]
    similarity = None
    if len(classes) > 1:
        rows = [[sentence(c.name, p, c.style) for p in c.phrases] or [sentence(c.name, "", c.style).rstrip(", ")]
                for c in classes]
        flat = TextFeatureCache().encode(clip, [s for row in rows for s in row]).cpu()
        means = torch.stack([part.mean(dim=0) for part in torch.split(flat, [len(r) for r in rows])])
        means = torch.nn.functional.normalize(means, dim=-1)
        cosine = means @ means.t()
        n = len(classes)
        similarity = float((cosine.sum() - cosine.diagonal().sum()) / (n * (n - 1)))
    return VocabularyCheck(clip=clip.name, classes=len(classes), unknown_word_share=_share(unknown, every),
                           unknown_name_share=_share([w for w in names if w in unknown], names),
                           text_similarity=None if similarity is None else round(similarity, 4),
                           unknown_words=tuple(unknown[:20]))


def _share(part: list[str], whole: list[str]) -> float:
    return round(len(part) / len(whole), 4) if whole else 0.0


def load_backbone(clip_name: str, pretrained: str | None, seed: int) -> LoadedClip:
    """The frozen CLIP as a run builds it (``FedMVP.build``: seeded, so a random-init one is the run's own),
    offline; the process's random state is left as it was. ``ClipLoadError`` when it cannot load."""
    import contextlib

    import torch

    from fedmvp.clip import _random_init_is_expected, load_clip

    chosen = contextlib.nullcontext() if pretrained else _random_init_is_expected()  # no weights: the preset's choice
    with torch.random.fork_rng(devices=[]), chosen:
        torch.manual_seed(seed)
        return load_clip(clip_name, pretrained or None)


def check(clip: LoadedClip, classes: list[RunClass] | None) -> VocabularyCheck | None:
    """Measure ``classes`` on ``clip`` and warn on stderr when the figures say so (None: no class set)."""
    from fedmvp.runs import warn

    if not classes:
        return None
    result = measure(clip, classes)
    if result.warns:
        warn(result.warning())
    return result


def check_run(run_path: str | Path, classes: list[RunClass] | None, clip: LoadedClip) -> VocabularyCheck | None:
    """``check``, and the figures recorded in RUN/vocabulary.json so a user can see them later."""
    result = check(clip, classes)
    write_record(run_path, result)
    return result


def check_preset(preset: Preset) -> VocabularyCheck | None:
    """``check`` for a [federation] preset's class set (its attribute file: `fedmvp serve` and `fedmvp join`
    before anything connects) on its backbone; None for a [[datasets]] preset, whose phrases come with its
    data. ``ClipLoadError`` / ``PresetError`` when the backbone or the attribute file cannot be read."""
    from fedmvp.run_classes import class_set_classes

    if preset.federation is None:
        return None
    classes = class_set_classes(preset)
    return check(load_backbone(preset.model.clip, preset.model.pretrained, preset.seed), classes)


def write_record(run_path: str | Path, result: VocabularyCheck | None) -> None:
    """RUN/vocabulary.json (atomic), where the run is a run (its config.json written) and there are figures."""
    if result is not None and (Path(run_path) / RUN_CONFIG).is_file():
        atomic.write_json(Path(run_path) / RECORD_FILE, result.record())


def recorded_warning(record: dict[str, Any] | None) -> str | None:
    """The warning line for figures read back from RUN/vocabulary.json (rebuilt from the numbers, so no text
    of a copied run reaches the terminal as it was written); None: no warning, or a record unusable."""
    from fedmvp_formats.shown import name_shown

    try:
        sim = record.get("text_similarity")  # type: ignore[union-attr]
        check = VocabularyCheck(clip=name_shown(str(record["clip"])), classes=int(record["classes"]),
                                unknown_word_share=float(record["unknown_word_share"]),
                                unknown_name_share=float(record["unknown_name_share"]),
                                text_similarity=None if sim is None else float(sim), unknown_words=())
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    return check.warning() if check.warns else None


def read_record(run_path: str | Path) -> dict[str, Any] | None:
    """The recorded figures (RUN/vocabulary.json), or None for a run without them or a record unreadable."""
    import json

    try:
        record = json.loads((Path(run_path) / RECORD_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return record if isinstance(record, dict) else None
