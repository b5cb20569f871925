"""The local training data: an ImageFolder tree of the bundle's classes, decoded once.

Scanning is separate from decoding so every problem with the folder (unknown class, no
images) is reported before torch loads or anything is decoded. Images are resized and
centre-cropped exactly as inference does (``edge_client.preprocess.resize_crop_rgb``) and
kept as uint8, so normalisation and the flipped view happen per batch on the training device.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedmvp_formats.folder_walk import FolderWalk
from fedmvp_formats.image_folder import held_out, stable_order
from fedmvp_formats.shown import path_shown

from edge_client.images import DEFAULT_MAX_PIXELS, ImageReadError, is_image_path, load_image
from edge_client.preprocess import PreprocessSpec, resize_crop_rgb
from edge_client.train_options import TrainInputError

@dataclass
class LocalDataset:
    """An ImageFolder tree resolved against the bundle's classes (paths only, nothing decoded)."""

    root: Path
    files: list[Path]
    labels: list[int]
    classes: list[str]  # class folders that hold images, sorted
    skipped: list[str] = field(default_factory=list)  # one line per file or folder left out

    def __len__(self) -> int:
        """Images found (some may still fail to decode)."""
        return len(self.files)


def scan_folder(root: str | os.PathLike, class_names: Sequence[str]) -> LocalDataset:
    """``root/<class>/**/image`` -> files and label indices into ``class_names``.

    Every non-hidden sub-directory of ``root`` must be a class of the bundle; unknown ones are
    a `TrainInputError` naming them. Image files directly in ``root`` are left out (reported)."""
    root = Path(root)
    if not root.is_dir():
        raise TrainInputError(f"{path_shown(root)}: not a directory (expected an ImageFolder tree: "
                              f"{path_shown(root)}/<class>/<image>)")
    index = {name: i for i, name in enumerate(class_names)}
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    unknown = [p.name for p in folders if p.name not in index]
    if unknown:
        shown = ", ".join(class_names[:20]) + (", ..." if len(class_names) > 20 else "")
        raise TrainInputError(f"{path_shown(root)}: unknown class{'es' if len(unknown) > 1 else ''} "
                              f"{', '.join(repr(u) for u in unknown)}: not in the bundle's {len(class_names)} "
                              f"classes ({shown})")
    if not folders:
        raise TrainInputError(f"{path_shown(root)}: no class folders (expected {path_shown(root)}/<class>/<image>)")
    skipped = [f"{path_shown(p)}: not in a class folder, left out" for p in sorted(root.iterdir())
               if p.is_file() and is_image_path(p)]
    walk = FolderWalk(root)  # the one rule (fedmvp_formats.folder_walk): no loop, nothing twice, no FIFO opened
    files: list[Path] = []
    labels: list[int] = []
    present: list[str] = []
    for folder in folders:
        found = sorted((Path(p) for p in walk.images(folder)), key=lambda f: f.relative_to(folder).as_posix())
        if found:
            present.append(folder.name)
        elif not walk.problems:  # said so: training silently without a class the user meant to teach is a surprise
            skipped.append(f"{path_shown(folder)}: empty class folder (no images), left out")
        files.extend(found)
        labels.extend([index[folder.name]] * len(found))
    if walk.problems:
        more = len(walk.problems) - 1
        raise TrainInputError(walk.problems[0] + (f" (and {more} more problems)" if more else ""))
    if not files:
        raise TrainInputError(f"{path_shown(root)}: no images, every class folder is empty "
                              f"({', '.join(path_shown(p.name) for p in folders[:10])}); "
                              f"put images in {path_shown(root)}/<class>/")
    return LocalDataset(root=root, files=files, labels=labels, classes=present, skipped=skipped)


def decode_dataset(dataset: LocalDataset, spec: PreprocessSpec, max_pixels: int | None = DEFAULT_MAX_PIXELS,
                   progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Resize + crop every image once: (uint8 [N, S, S, 3], labels [N]); unreadable files are skipped."""
    arrays, labels = [], []
    for path, label in _progress(list(zip(dataset.files, dataset.labels)), progress, "read"):
        try:
            arrays.append(resize_crop_rgb(load_image(path, max_pixels=max_pixels), spec))
            labels.append(label)
        except ImageReadError as err:
            dataset.skipped.append(str(err))
    if not arrays:
        raise TrainInputError(f"{path_shown(dataset.root)}: none of the {len(dataset.files)} images could be read")
    return np.stack(arrays), np.asarray(labels, dtype=np.int64)


def images_digest(pixels: np.ndarray, labels: np.ndarray) -> str:
    """sha256 of the images a training used, whatever their order or file names: each image's class and
    decoded pixels hashed, the sorted hashes hashed. Written into the update file (``images_digest``), so
    `fedmvp ingest` counts two updates over the same images once (docs/howto/ingest.md)."""
    each = sorted(hashlib.sha256(np.int64(label).tobytes() + np.ascontiguousarray(image).tobytes()).digest()
                  for image, label in zip(pixels, labels))
    return hashlib.sha256(b"".join(each)).hexdigest()


def _progress(items: list, progress: bool, desc: str) -> Any:
    """``items``, behind a tqdm bar on stderr when ``progress``."""
    if not progress:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="img", file=sys.stderr, leave=False, dynamic_ncols=True)


def held_out_split(dataset: LocalDataset, fraction: float) -> tuple[LocalDataset, LocalDataset]:
    """(train, evaluation) shares of ``dataset``: per class, ``fedmvp_formats.image_folder.held_out``
    (by the sha256 of each path; a class with one image keeps it for training). Stable: the same
    folder gives the same split every round and on every restart."""
    if not 0.0 < fraction < 1.0:
        raise TrainInputError(f"the held-out fraction must be in (0, 1), got {fraction}")
    by_class: dict[int, list[Path]] = {}
    for path, label in zip(dataset.files, dataset.labels):
        by_class.setdefault(label, []).append(path)
    train, held = LocalDataset(dataset.root, [], [], [], list(dataset.skipped)), LocalDataset(dataset.root, [], [], [])
    for label, paths in sorted(by_class.items()):
        by_name = {str(p.relative_to(dataset.root)): p for p in paths}
        ordered = [by_name[n] for n in stable_order(by_name)]  # the one rule (fedmvp_formats.image_folder)
        cut = len(held_out(by_name, fraction))
        for part, chosen in ((held, ordered[:cut]), (train, ordered[cut:])):
            part.files.extend(chosen)
            part.labels.extend([label] * len(chosen))
    for part in (train, held):
        part.classes = sorted({p.relative_to(dataset.root).parts[0] for p in part.files})
    return train, held
