"""Readers for the image layouts users already have; each returns ``LabelledImages``.

Why one return type: partitions, k-shot sampling and evaluation only need ``(path, label)``
pairs plus the class name of every label, so every layout is reduced to exactly that, with
class names indexed explicitly by label (never by the order entries happen to appear in).

Layouts (``layout`` key of a preset dataset; each a ``Layout`` of ``builtin_layouts.py``, named in
``layout_table.py``, where ``register_layout`` adds others)::

    imagefolder  ROOT/<split>/<class>/*.jpg         labels = sorted class folders (torchvision), or
                                                     the order of ``class_names_file``
    coop         ROOT/split_zhou_<Dataset>.json      {"train"|"val"|"test": [[relpath, label, name]]}
                 ROOT/<image_dir>/<relpath>          labels and names taken from the entries
    domainbed    ROOT/<domain>/<class>/*.jpg         labels = sorted class folders, same in every domain
    synthetic    ROOT/<domain>/<split>/<class>/*.png labels = world.json's class order
                 ROOT/world.json, ROOT/attributes.json

CoOp's usual trees (``root`` = the dataset folder, ``split_file`` and ``image_dir`` relative to it)::

    dataset        root             split_file                            image_dir
    Caltech101     caltech-101      split_zhou_Caltech101.json            101_ObjectCategories
    OxfordFlowers  oxford_flowers   split_zhou_OxfordFlowers.json         jpg
    OxfordPets     oxford_pets      split_zhou_OxfordPets.json            images
    Food101        food-101         split_zhou_Food101.json               images
    DTD            dtd              split_zhou_DescribableTextures.json   images
    StanfordCars   stanford_cars    split_zhou_StanfordCars.json          (the root itself)
    UCF101         ucf101           split_zhou_UCF101.json                UCF-101-midframes
    SUN397         sun397           split_zhou_SUN397.json                SUN397
    EuroSAT        eurosat          split_zhou_EuroSAT.json               2750
    FGVCAircraft   fgvc_aircraft    (none shipped: ``write_aircraft_split``) images
    ImageNet       imagenet         (none: use imagefolder on images/{train,val} with classnames.txt)
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from fedmvp_formats.folder_walk import FolderWalk
from fedmvp_formats.shown import path_shown


PathLike = str | os.PathLike


log = logging.getLogger("fedmvp.data")


class LayoutError(ValueError):
    """A data tree or split file that cannot be read as its layout; the message names the path."""


@dataclass
class LabelledImages:
    """``(path, label)`` pairs and the class name of each label (``class_names[label]``)."""

    samples: list[tuple[str, int]]
    class_names: list[str]
    domain: str | None = None
    counts: dict[int, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.counts = dict(Counter(label for _, label in self.samples))

    def __len__(self) -> int:
        return len(self.samples)

    def subset(self, labels: list[int]) -> "LabelledImages":
        """Only the classes ``labels`` (in that order), relabelled 0..len(labels)-1."""
        remap = {old: new for new, old in enumerate(labels)}
        samples = [(p, remap[y]) for p, y in self.samples if y in remap]
        return LabelledImages(samples, [self.class_names[y] for y in labels], self.domain)


def images_under(folder: Path, walk: FolderWalk | None = None) -> list[str]:
    """Image files below ``folder`` (recursively, like torchvision), in a stable order, by the one
    walking rule (``fedmvp_formats.folder_walk``; ``walk``: the walk of the tree ``folder`` is a class
    of, so an image reached from two classes is caught). A refusal is a `LayoutError` (its first line)."""
    walk = walk or FolderWalk(folder)
    found = walk.images(folder)
    if walk.problems:
        more = len(walk.problems) - 1
        raise LayoutError(walk.problems[0] + (f" (and {more} more problems)" if more else ""))
    return found


def _report_empty(root: Path, folders: list[str], samples: list[tuple[str, int]]) -> list[str]:
    """Class folders of ``root`` that hold no image: each is named in one warning line (the class then
    has no images in this split, so the split's accuracy silently leaves it out). Returned for tests."""
    present = {label for _, label in samples}
    empty = [folder for label, folder in enumerate(folders) if label not in present]
    for folder in empty:
        log.warning("%s: class folder %r holds no images; that class is left out of this split",
                    path_shown(root), folder)
    return empty


def _class_folders(root: Path) -> list[str]:
    if not root.is_dir():
        raise LayoutError(f"{root}: no such directory")
    return sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))


def read_class_names_file(path: PathLike) -> list[tuple[str, str]]:
    """``(folder, class name)`` pairs in label order.

    Text: one class a line, ``<folder> <name words>`` (CoOp's ImageNet ``classnames.txt``)
    or just ``<name>``; JSON: a list of names or a ``{folder: name}`` object.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise LayoutError(f"{path}: cannot read class names file ({exc.strerror or exc})") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise LayoutError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
        pairs = list(data.items()) if isinstance(data, dict) else [(n, n) for n in data]
    else:
        pairs = []
        for line in text.splitlines():
            parts = line.strip().split(maxsplit=1)
            if parts and not parts[0].startswith("#"):
                pairs.append((parts[0], parts[1] if len(parts) > 1 else parts[0]))
    if not pairs or not all(isinstance(f, str) and isinstance(n, str) for f, n in pairs):
        raise LayoutError(f"{path}: expected class names (one per line, or a JSON list/object)")
    dupes = sorted(f for f, c in Counter(f for f, _ in pairs).items() if c > 1)
    if dupes:
        raise LayoutError(f"{path}: duplicate folders: {', '.join(dupes[:5])}")
    return pairs


def imagefolder_classes(root: PathLike, class_names_file: PathLike | None = None
                        ) -> tuple[list[str], list[str]]:
    """``(folders, class names)`` in label order, without listing any image (see read_imagefolder)."""
    root = Path(root)
    folders = _class_folders(root)
    if class_names_file is None:
        return folders, list(folders)
    pairs = read_class_names_file(class_names_file)
    by_folder = dict(pairs)
    if folders and all(f.isdigit() for f in folders) and not any(f in by_folder for f in folders):
        by_folder = {str(i): name for i, (_, name) in enumerate(pairs)}
        order = [str(i) for i in range(len(pairs))]
    else:
        order = [f for f, _ in pairs]
    unknown = [f for f in folders if f not in by_folder]
    if unknown:
        raise LayoutError(f"{root}: {len(unknown)} class folders not in {class_names_file}: "
                          f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
    present = set(folders)
    chosen = [f for f in order if f in present]
    return chosen, [by_folder[f] for f in chosen]


def read_imagefolder(root: PathLike, class_names_file: PathLike | None = None,
                     domain: str | None = None) -> LabelledImages:
    """An ImageFolder tree ``root/<class>/...``.

    Without ``class_names_file`` labels follow the sorted folder names (as torchvision does).
    With it, labels follow the file's order restricted to the folders present (so ImageNet-A/R,
    which hold 200 of ImageNet's folders, get a 200-class label space with ImageNet's names);
    integer folders ``0..N-1`` (ImageNet-V2) are taken as indices into the file.
    """
    root = Path(root)
    folders, names = imagefolder_classes(root, class_names_file)
    walk = FolderWalk(root)
    samples = [(p, label) for label, folder in enumerate(folders)
               for p in images_under(root / folder, walk)]
    _report_empty(root, folders, samples)
    return LabelledImages(samples, names, domain)


def _coop_class_table(path: Path, data: dict) -> list[str]:
    """Class name of each label from every entry of every split; gaps and conflicts are errors."""
    by_label: dict[int, str] = {}
    for split, entries in data.items():
        for i, entry in enumerate(entries):
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                    and isinstance(entry[1], int) and not isinstance(entry[1], bool)
                    and isinstance(entry[2], str) and entry[1] >= 0):
                raise LayoutError(f"{path}: {split}[{i}] is not [relpath, label, classname]: "
                                  f"{str(entry)[:80]}")
            _, label, name = entry
            if by_label.setdefault(label, name) != name:
                raise LayoutError(f"{path}: label {label} is both {by_label[label]!r} and {name!r}")
    if not by_label:
        raise LayoutError(f"{path}: no entries")
    gaps = [y for y in range(max(by_label) + 1) if y not in by_label]
    if gaps:
        raise LayoutError(f"{path}: labels without any entry: {', '.join(map(str, gaps[:10]))}")
    names = [by_label[y] for y in range(len(by_label))]
    dupes = sorted(n for n, c in Counter(names).items() if c > 1)
    if dupes:
        raise LayoutError(f"{path}: class names with several labels: {', '.join(dupes[:5])}")
    return names


def read_coop_split(split_json: PathLike, image_root: PathLike, split: str = "train",
                    domain: str | None = None) -> LabelledImages:
    """One split of a CoOp ``split_zhou_<Dataset>.json``; image paths are relative to ``image_root``.

    The class table comes from all splits of the file, so the test split's new classes and the
    train split's base classes share one label space.
    """
    path = Path(split_json)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise LayoutError(f"{path}: cannot read split file ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise LayoutError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
        raise LayoutError(f"{path}: expected {{\"train\": [...], \"val\": [...], \"test\": [...]}}")
    if split not in data:
        raise LayoutError(f"{path}: no split {split!r} (has {', '.join(data)})")
    names = _coop_class_table(path, data)
    root = Path(image_root)
    samples = [(str(root / rel), label) for rel, label, _ in data[split]]
    return LabelledImages(samples, names, domain)


def domainbed_domains(root: PathLike) -> list[str]:
    """Domain folders of a DomainBed dataset, sorted."""
    return _class_folders(Path(root))


def domainbed_classes(root: PathLike) -> list[str]:
    """The class folders shared by every domain of ``root`` (sorted); domains that differ are an error."""
    root = Path(root)
    domains = domainbed_domains(root)
    if not domains:
        raise LayoutError(f"{root}: no domain folders")
    classes = _class_folders(root / domains[0])
    for other in domains[1:]:
        theirs = _class_folders(root / other)
        if theirs != classes:
            diff = sorted(set(classes) ^ set(theirs))
            raise LayoutError(f"{root}: domains {domains[0]!r} and {other!r} differ in classes: "
                              f"{', '.join(diff[:5])}")
    return classes


def read_domainbed(root: PathLike, domain: str) -> LabelledImages:
    """All images of one domain of ``root/<domain>/<class>/``; every domain must share its classes."""
    root = Path(root)
    domains = domainbed_domains(root)
    if domain not in domains:
        raise LayoutError(f"{root}: no domain {domain!r} (has {', '.join(domains) or 'none'})")
    classes = domainbed_classes(root)
    walk = FolderWalk(root / domain)
    samples = [(p, label) for label, c in enumerate(classes) for p in images_under(root / domain / c, walk)]
    _report_empty(root / domain, classes, samples)
    return LabelledImages(samples, classes, domain)


def read_world_meta(root: PathLike) -> dict:
    """``world.json`` of a synthetic world."""
    path = Path(root) / "world.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        classes = sorted(meta["classes"], key=lambda c: c["label"])
    except OSError as exc:
        raise LayoutError(f"{path}: cannot read world description ({exc.strerror or exc})") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise LayoutError(f"{path}: not a world description ({exc})") from None
    if [c["label"] for c in classes] != list(range(len(classes))):
        raise LayoutError(f"{path}: class labels are not 0..{len(classes) - 1}")
    meta["classes"] = classes
    return meta


def read_synthetic(root: PathLike, domain: str, split: str, only: set[str] | None = None) -> LabelledImages:
    """``root/<domain>/<split>`` of the synthetic world, labelled in world.json's class order
    (``only``: just these classes' folders are listed, one site's)."""
    root = Path(root)
    meta = read_world_meta(root)
    if domain not in meta.get("domains", []):
        raise LayoutError(f"{root}: world has no domain {domain!r} (has {', '.join(meta.get('domains', []))})")
    names = [c["name"] for c in meta["classes"]]
    label_of = {n: i for i, n in enumerate(names)}
    folder = root / domain / split
    present = _class_folders(folder)
    unknown = [c for c in present if c not in label_of]
    if unknown:
        raise LayoutError(f"{folder}: class folders not in world.json: {', '.join(unknown[:5])}")
    walk = FolderWalk(folder)
    samples = [(p, label_of[c]) for c in sorted(present, key=label_of.__getitem__) if only is None or c in only
               for p in images_under(folder / c, walk)]
    return LabelledImages(samples, names, domain)


def write_aircraft_split(root: PathLike, out: PathLike | None = None) -> Path:
    """A CoOp-format split file for FGVC-Aircraft from its own lists (CoOp ships none).

    Reads ``root/variants.txt`` and ``root/images_variant_{train,val,test}.txt`` (``<id> <variant>``),
    labels = order of variants.txt; writes ``root/split_zhou_FGVCAircraft.json`` (paths relative to
    ``root/images``).
    """
    root = Path(root)
    try:
        variants = [v.strip() for v in (root / "variants.txt").read_text().splitlines() if v.strip()]
        label_of = {v: i for i, v in enumerate(variants)}
        data = {}
        for split in ("train", "val", "test"):
            rows = (root / f"images_variant_{split}.txt").read_text().splitlines()
            data[split] = [[f"{img}.jpg", label_of[v], v] for img, v in
                           (r.strip().split(" ", 1) for r in rows if r.strip())]
    except (OSError, KeyError) as exc:
        raise LayoutError(f"{root}: not an FGVC-Aircraft data folder ({exc})") from None
    out = Path(out) if out else root / "split_zhou_FGVCAircraft.json"
    out.write_text(json.dumps(data))
    return out
