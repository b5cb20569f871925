"""A real site's folder: ``DIR/<class>/<image>`` (or ``DIR/train/`` + ``DIR/test/``), checked and split.

Why a module of its own: a site of a ``[federation]`` preset holds only its own images, so what it
trains and evaluates on is read from its folder alone, never from a listing of the federation's data
(docs/architecture.md "Sites that hold their own data"). The layout is the one ``edge-client train
--data`` reads; the image files and the held-out share are ``fedmvp_formats.image_folder``'s, so a
site's split equals a device's.

Everything is checked before anything starts: a class folder not in the federation's class set, an
empty class folder, an image that does not decode in full (as training decodes it, so the counts a site
reports are the images it trains on) and what the walking rule refuses (a link back into the folder, a
file reached twice, a FIFO: ``fedmvp_formats.folder_walk``) are each one line naming the path, escaped
(``SiteFolderError`` holds the lines; the CLI prints them and exits 2).

Images are counted by content, names after Unicode normalisation (what a site reports is weighed by the
server, docs/security.md "Replayed and duplicated updates"): byte-identical files are one image (the
first by path counts; `SiteImages.duplicates` says how many copies were left out, which `fedmvp join`
says in one line), a class folder spelt in another normalisation form (NFD ``café``) is that class, and
two folders of one class in two spellings are refused (one line).
"""

from __future__ import annotations

import hashlib
import os
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

from fedmvp_formats.folder_walk import FolderWalk
from fedmvp_formats.image_folder import held_out
from fedmvp_formats.shown import path_shown, shown

from fedmvp.data.image_decode import decode_problem

Sample = tuple[str, int]


class SiteFolderError(ValueError):
    """A site folder that cannot be used: one line per problem, each naming its path."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass
class SiteImages:
    """A site's images labelled in the federation's class order: what it trains on and evaluates."""

    root: Path
    train: list[Sample]  # base classes only: new classes are never trained on
    test: list[Sample]  # the held-out share of base classes, and every image of a new class
    counts: dict[str, int] = field(default_factory=dict)  # images per class, as the server records them
    duplicates: int = 0  # files left out as byte-identical copies of an image counted already

    def classes(self, labels: list[int]) -> list[int]:
        """The labels of ``labels`` this site holds training images of (its own label space)."""
        have = {y for _, y in self.train}
        return [y for y in labels if y in have]


def _class_folders(walk: FolderWalk, root: Path, classes: list[str], problems: list[str]) -> dict[str, list[str]]:
    """``{class: image paths}`` of one ``root/<class>/`` tree, walked by ``walk`` (the one rule,
    ``fedmvp_formats.folder_walk``); problems appended, one line each."""
    if not root.is_dir():
        problems.append(f"{path_shown(root)}: not a directory (expected {path_shown(root)}/<class>/<image>)")
        return {}
    known = {unicodedata.normalize("NFC", c): c for c in classes}  # names compared after normalisation
    found: dict[str, list[str]] = {}
    spelt: dict[str, str] = {}  # class -> the folder name that holds it
    for entry in sorted((e for e in os.scandir(root) if not e.name.startswith(".")), key=lambda e: e.name):
        path = Path(entry.path)
        if not entry.is_dir():
            continue
        name = known.get(unicodedata.normalize("NFC", entry.name))
        if name is None:
            problems.append(f"{path_shown(path)}: class {shown(entry.name)} is not in the federation's class set "
                            f"({len(classes)} classes)")
            continue
        if name in spelt:
            problems.append(f"{path_shown(path)}: a second folder of class {shown(name)} (also "
                            f"{shown(spelt[name])}: one name in two Unicode spellings); keep one")
            continue
        spelt[name] = entry.name
        before = len(walk.refusals)
        images = walk.images(path)
        if len(walk.refusals) > before:
            continue
        if not images:
            problems.append(f"{path_shown(path)}: empty class folder (no images)")
            continue
        # decoded as training decodes them: what is counted here is what a round trains on
        problems.extend(f"{path_shown(p)}: unreadable image ({why})" for p in images
                        if (why := decode_problem(p)) is not None)
        found[name] = images
    if not found and not problems and not walk.problems:
        problems.append(f"{path_shown(root)}: no class folders (expected {path_shown(root)}/<class>/<image>)")
    return found


def read_site_folder(root: str | os.PathLike, classes: list[str], new_classes: list[str],
                     eval_fraction: float) -> SiteImages:
    """The site's images in ``classes``' label space: ``root/train`` and ``root/test`` when both exist,
    else a stable held-out share (``eval_fraction`` per class, by file name) of ``root/<class>/``.
    Images of ``new_classes`` go to evaluation only. `SiteFolderError` lists every problem."""
    root = Path(root)
    label = {c: i for i, c in enumerate(classes)}
    new = set(new_classes)
    problems: list[str] = []
    split = (root / "train").is_dir() and (root / "test").is_dir()
    walk = FolderWalk(root)
    if split:
        train_tree = _class_folders(walk, root / "train", classes, problems)
        test_tree = _class_folders(walk, root / "test", classes, problems)
    else:
        train_tree = _class_folders(walk, root, classes, problems)
        test_tree = {}
    problems = walk.problems + problems
    if problems:
        raise SiteFolderError(problems)
    copies = _copies([*(p for ps in train_tree.values() for p in ps), *(p for ps in test_tree.values() for p in ps)])
    train_tree = {c: [p for p in ps if p not in copies] for c, ps in train_tree.items()}
    test_tree = {c: [p for p in ps if p not in copies] for c, ps in test_tree.items()}
    train: list[Sample] = []
    test: list[Sample] = []
    counts: dict[str, int] = {}
    for name in classes:  # the federation's class order, so labels are stable across sites
        own, held = train_tree.get(name, []), test_tree.get(name, [])
        if not split:
            base = str(root)
            out = held_out((os.path.relpath(p, base) for p in own), eval_fraction) if eval_fraction > 0 else set()
            held = [p for p in own if os.path.relpath(p, base) in out]
            own = [p for p in own if os.path.relpath(p, base) not in out]
        if name in new:  # held out of training everywhere (docs/method.md §7: New)
            held, own = sorted(own + held), []
        train += [(p, label[name]) for p in own]
        test += [(p, label[name]) for p in held]
        if own or held:
            counts[name] = len(own) + len(held)
    if not train:
        raise SiteFolderError([f"{path_shown(root)}: no training images of a base class "
                               f"(new classes are only evaluated)"])
    return SiteImages(root, train, test, counts, duplicates=len(copies))


def _copies(paths: list[str]) -> set[str]:
    """The files that are byte for byte an earlier one (in path order): an image counts once however many
    copies of it a folder holds, in one class, in two, or in train and test (where it would also leak)."""
    first: dict[str, str] = {}
    copies = set()
    for path in sorted(paths):
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest() in first:
            copies.add(path)
        else:
            first[digest.hexdigest()] = path
    return copies
