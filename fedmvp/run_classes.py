"""The run's class set (RUN/classes.json): every class of the federation, base then new, in the set's
order, each with its attribute phrases and sentence style.

Why a record of its own: an export bakes exactly this set into the bundle (the ONNX model's labels
and its text features, docs/method.md §2). Written when the run is created, it lets ``fedmvp-export``
work on a machine that holds the run directory and nothing else; before it existed the exporter
rebuilt the whole federation from the preset and its data just to learn the names and phrases
(docs/architecture.md, Records that travel; a run without it is migrated there, Migrations).

The order is decided once, here (``federation_classes``), for both the record and that migration,
so a run exported either way bakes the same labels in the same order.

The set's one identity is its class-set digest (``fedmvp_formats.class_set``: ordered names and each
class's phrases), recorded here since format 2 (a format-1 file is read and its digest computed):
every train and evaluate message carries it, and a site or device with another set is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedmvp_formats.class_set import ClassSet
from fedmvp_formats.files import MISSING, RUN_CLASSES, JsonRecordError, read_json_object

from fedmvp import atomic
from fedmvp.attributes.sentences import SentenceStyle

CLASSES_FILE = RUN_CLASSES  # ``RunDir.CLASSES``: the one spelling is the leaf's
FORMAT = "fedmvp-classes"
FORMAT_VERSION = 2  # 2: the class-set digest (``digest``)


class ClassRecordError(ValueError):
    """classes.json that cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class RunClass:
    """One class of the run's set: its name, its K attribute phrases and the style its sentences take."""

    name: str
    phrases: tuple[str, ...]
    style: SentenceStyle

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "phrases": list(self.phrases),
                "style": {"prefix": self.style.prefix, "suffix": self.style.suffix}}


def federation_classes(federation) -> list[RunClass]:
    """Base then new classes of every dataset (deduplicated, first occurrence wins), phrases cut to the
    preset's K (``num_attributes``). Without base/new evaluations (domain protocols) every evaluated or
    trained class is taken. ``federation``: a ``fedmvp.data.federation.Federation``."""
    evals = [e for e in federation.evaluations if e.kind in ("base", "new")]
    groups = [(e.class_names, e.attributes, e.style) for e in evals]
    if not groups:
        groups = [(e.class_names, e.attributes, e.style) for e in federation.evaluations]
        groups += [(c.class_names, c.attributes, c.style) for c in federation.clients]
    known: dict[str, list[str]] = {}
    for group in [*groups, *((c.class_names, c.attributes, c.style) for c in federation.clients)]:
        for name, phrases in group[1].items():
            known.setdefault(name, list(phrases))
    styles: dict[str, SentenceStyle] = {}
    for class_names, _, style in groups:
        for name in class_names:
            styles.setdefault(name, style)
    k = getattr(getattr(federation.preset, "train", None), "num_attributes", None)
    return [RunClass(name, tuple(known.get(name, [])[:k] if k else known.get(name, [])), style)
            for name, style in styles.items()]


def class_set_classes(preset) -> list[RunClass]:
    """A ``[federation]`` preset's class set from its attribute file alone (no image: the server of a
    deployment, whose sites hold the data): base then new, each in the file's order, phrases cut to K,
    the style its sites' sets take (``site_federation``). ``preset``: a ``fedmvp.presets.schema.Preset``."""
    from fedmvp.data.federation_plan import plan_federation
    from fedmvp.data.site_federation import site_attributes, site_style

    plan = plan_federation(preset)[0]
    attributes, style, names = site_attributes(preset, plan), site_style(preset), plan.classes.class_names
    return [RunClass(names[y], tuple(attributes[names[y]]), style) for y in [*plan.classes.trained, *plan.classes.new]]


def class_set(classes: list[RunClass]) -> ClassSet:
    """The set as it travels and is compared (names in order, one phrases digest per class)."""
    return ClassSet.of([(c.name, c.phrases) for c in classes])


def write_classes(run_path: Path, classes: list[RunClass]) -> Path:
    """RUN/classes.json, atomically (a reader sees the old file or the whole new one)."""
    path = Path(run_path) / CLASSES_FILE
    atomic.write_json(path, {"format": FORMAT, "format_version": FORMAT_VERSION,
                             "digest": class_set(classes).digest, "classes": [c.record() for c in classes]})
    return path


def read_classes(run_path: Path) -> list[RunClass] | None:
    """The recorded class set; None when the run has no classes.json (a run of an older fedmvp).
    A file that is there but unusable is refused (ClassRecordError, one line naming it)."""
    path = Path(run_path) / CLASSES_FILE
    try:
        record = read_json_object(path)  # the run's one rule for its JSON records (never through a link)
    except JsonRecordError as err:
        if err.problem == MISSING:
            return None
        raise ClassRecordError(str(err)) from None
    if record.get("format") != FORMAT:
        raise ClassRecordError(f"{path}: not a {FORMAT} record")
    version = record.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= FORMAT_VERSION:
        raise ClassRecordError(f"{path}: format_version {version!r} (this fedmvp reads 1..{FORMAT_VERSION})")
    entries = record.get("classes")
    if not isinstance(entries, list) or not entries:
        raise ClassRecordError(f"{path}: classes must be a non-empty list")
    classes = [_entry(path, i, e) for i, e in enumerate(entries)]
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        raise ClassRecordError(f"{path}: duplicate class names")
    if version >= 2 and record.get("digest") != class_set(classes).digest:
        raise ClassRecordError(f"{path}: digest is not the digest of its classes and phrases (edited by hand?)")
    return classes


def _entry(path: Path, i: int, entry: Any) -> RunClass:
    where = f"{path}: classes[{i}]"
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
        raise ClassRecordError(f"{where}: needs a non-empty name")
    phrases, style = entry.get("phrases"), entry.get("style")
    if not isinstance(phrases, list) or not all(isinstance(p, str) for p in phrases):
        raise ClassRecordError(f"{where} ({entry['name']!r}): phrases must be a list of strings")
    if not isinstance(style, dict) or not all(isinstance(style.get(k), str) for k in ("prefix", "suffix")):
        raise ClassRecordError(f"{where} ({entry['name']!r}): style needs prefix and suffix strings")
    return RunClass(entry["name"], tuple(phrases), SentenceStyle(prefix=style["prefix"], suffix=style["suffix"]))
