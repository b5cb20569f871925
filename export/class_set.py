"""The class set a bundle bakes in: class names in label order, their attribute phrases and sentence
styles, and their [C, K, E] text features.

From the run (``run_class_set``: its recorded class set, base then new classes of every dataset) or from any
``{class: [phrases]}`` file (``file_class_set``: classes nobody trained on included).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from export.errors import ExportError
from fedmvp.attributes.sentences import SentenceStyle, build_sentences
from fedmvp.clip import LoadedClip
from fedmvp.run_classes import CLASSES_FILE, RunClass, federation_classes
from fedmvp.runs import MIGRATIONS, RunDir, RunError, warn


@dataclass
class ClassSet:
    """Classes in label order with their attribute phrases and sentence style."""

    names: list[str]
    attributes: dict[str, list[str]]
    styles: dict[str, SentenceStyle] = field(default_factory=dict)
    source: str = "explicit"

    def style(self, name: str) -> SentenceStyle:
        return self.styles.get(name, SentenceStyle())

    @property
    def k(self) -> int:
        return min(len(self.attributes[c]) for c in self.names)

    def validate(self) -> None:
        if not self.names:
            raise ExportError(f"{self.source}: the class set is empty")
        if len(set(self.names)) != len(self.names):
            raise ExportError(f"{self.source}: duplicate class names")
        missing = [c for c in self.names if not self.attributes.get(c)]
        if missing:
            raise ExportError(f"{self.source}: no attribute phrases for {', '.join(missing[:5])}")
        counts = Counter(len(self.attributes[c]) for c in self.names)
        if len(counts) > 1:  # K is one number (docs/method.md §2); min() would cut every class to the shortest
            k = counts.most_common(1)[0][0]
            odd = [f"{c!r} has {len(self.attributes[c])}" for c in self.names if len(self.attributes[c]) != k]
            raise ExportError(f"{self.source}: every class needs the same number of phrases (K); most have {k}, "
                              f"but {', '.join(odd[:5])}{' ...' if len(odd) > 5 else ''}")


def text_features(clip: LoadedClip, classes: ClassSet, cache=None) -> torch.Tensor:
    """[C, K, E] attribute features, one sentence style per run of consecutive classes.

    Computed afresh (memory cache only): a disk entry is keyed by the weights' tag, not their
    bytes, so it could be stale after shipped weights are rebuilt, and C*K sentences are cheap."""
    from fedmvp.attributes.cache import TextFeatureCache

    cache = cache or TextFeatureCache(use_disk=False)
    k, groups, start = classes.k, [], 0
    for i in range(1, len(classes.names) + 1):
        if i == len(classes.names) or classes.style(classes.names[i]) != classes.style(classes.names[start]):
            names = classes.names[start:i]
            groups.append(cache.class_features(clip, build_sentences(names, classes.attributes,
                                                                     classes.style(names[0]), k=k)))
            start = i
    return torch.cat(groups)


def run_class_set(run: RunDir) -> ClassSet:
    """The run's class set, base then new classes in the set's order: the run's record
    (RUN/classes.json, ``RunDir.class_set``), so the run directory alone suffices. A run made before
    that record existed is migrated: the same order rebuilt from its recorded preset and data
    (``federation_classes`` of ``RunDir.federation``), with one warning (docs/architecture.md, Migrations)."""
    try:
        recorded = run.class_set()
        if recorded is None:
            warn(f"{run.path / CLASSES_FILE}: no class record (a run of an older fedmvp); rebuilding the class "
                 f"set from the run's preset and data ({MIGRATIONS})")
            recorded = federation_classes(run.federation())
    except RunError as err:
        raise ExportError(str(err)) from None
    return class_set_of(recorded)


def class_set_of(classes: list[RunClass], source: str = "run") -> ClassSet:
    """A ``ClassSet`` of the run's classes (the record's or the migration's: one shape, one order)."""
    return ClassSet(names=[c.name for c in classes], attributes={c.name: list(c.phrases) for c in classes},
                    styles={c.name: c.style for c in classes}, source=source)


def file_class_set(path: Path, domain: str | None = None) -> ClassSet:
    """Any class set from a ``{class: [phrases]}`` file (classes nobody trained on included)."""
    from fedmvp.attributes.files import AttributeFileError, load_attributes

    try:
        attributes = load_attributes(path, k=None)
    except AttributeFileError as err:
        raise ExportError(str(err)) from None
    style = SentenceStyle.for_domain(domain)
    names = list(attributes)
    classes = ClassSet(names=names, attributes=attributes, styles={n: style for n in names}, source=str(path))
    classes.validate()  # before the model is loaded: a bad file is reported at once
    return classes
