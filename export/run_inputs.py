"""What an export reads from a run: its directory, the round's checkpoint and method record,
the CLIP's preprocessing, and the parity / calibration images.

Kept apart from the writer so the export core can be driven with explicit arguments (a model,
a class set, images) and this layer stays thin: find the run, rebuild the model by the one rebuild
(``FedMVP.from_run``: the round's method record + its tensors, never defaults or tensor shapes),
take the class set from the run's record (``export.class_set.run_class_set``) and the parity and
calibration images from ``--images``, the run's data where reachable, or generated pixels (``export_images``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge_client.preprocess import PreprocessSpec
from export.errors import ExportError
from export.parity import MIN_IMAGES
from fedmvp.clip import ClipLoadError, LoadedClip
from fedmvp.model import FedMVP
from fedmvp.runs import Checkpoint, RunDir, RunError


def preprocess_spec(clip: LoadedClip) -> PreprocessSpec:
    """The manifest's preprocessing, read off open_clip's eval transform (refuses what the edge lacks)."""
    from torchvision import transforms as T

    size, mean, std, resize = clip.image_size, None, None, None
    for step in getattr(clip.preprocess, "transforms", []):
        if isinstance(step, T.Resize):
            mode = step.interpolation.value if hasattr(step.interpolation, "value") else str(step.interpolation)
            resize = f"{mode}-shortest-side"
            if not isinstance(step.size, int) and len(step.size) != 1:
                raise ExportError(f"{clip.name}: non-square resize {step.size} is not supported on the edge")
        elif isinstance(step, T.Normalize):
            mean, std = tuple(float(v) for v in step.mean), tuple(float(v) for v in step.std)
    if mean is None or resize is None:
        raise ExportError(f"{clip.name}: cannot read resize/normalisation from the CLIP transform")
    try:
        return PreprocessSpec(image_size=size, mean=mean, std=std, resize=resize)
    except ValueError as err:
        raise ExportError(f"{clip.name}: {err}") from None


# ---- the run ------------------------------------------------------------------------------------
def find_run(run: str | Path | None, runs_root: Path = Path("runs")) -> RunDir:
    """``run`` or the newest directory under ./runs that holds a config.json."""
    if run is not None:
        path = Path(run)
        if not RunDir(path).exists():
            raise ExportError(f"{path}: not a fedmvp run (no config.json)")
        return RunDir(path)
    candidates = [p for p in runs_root.glob("*") if RunDir(p).exists()] if runs_root.is_dir() else []
    if not candidates:
        raise ExportError(f"{runs_root}: no run found (pass --run DIR)")
    return RunDir(max(candidates, key=lambda p: (p.stat().st_mtime, p.name)))


def read_config(run: RunDir) -> dict[str, Any]:
    """The run's record, its CLIP entry checked before any heavy work."""
    try:
        config = run.read_config()
        run.clip_spec()
    except RunError as err:
        raise ExportError(str(err)) from None
    return config


def load_checkpoint(run: RunDir, round_number: int | None) -> Checkpoint:
    """The round's checkpoint; `RunDir.load_checkpoint` already refuses one holding NaN or inf (exported,
    every logit would be NaN and parity would agree 100% with the diverged training), naming the tensor."""
    try:
        return run.load_checkpoint(round_number)
    except RunError as err:
        raise ExportError(str(err)) from None


def rebuild_model(run: RunDir, checkpoint: Checkpoint) -> FedMVP:
    """The round's model by the one rebuild (``FedMVP.from_run``: seed, CLIP, method record, weights)."""
    try:
        return FedMVP.from_run(run, checkpoint)
    except (RunError, ClipLoadError) as err:
        raise ExportError(str(err)) from None


def run_images(federation, preprocess, count: int) -> tuple[torch.Tensor, list[str]]:
    """Up to ``count`` preprocessed test images, evenly spread over the run's evaluation sets, and the
    class name of each (held-out labels: what int8's accuracy bound is measured on).

    Unreadable files are skipped (the caller tops up with synthetic images)."""
    samples = [(path, e.class_names[label]) for e in federation.evaluations for path, label in e.samples]
    samples += [(path, c.class_names[label]) for c in federation.clients for path, label in c.test]
    return _spread_images(samples, preprocess, count)


def run_training_images(federation, preprocess, count: int) -> torch.Tensor:
    """Up to ``count`` preprocessed training images of the run's clients (int8 calibration: kept
    apart from the test images that the parity check then judges on)."""
    return _spread_images([(path, "") for c in federation.clients for path, _ in c.train], preprocess, count)[0]


def _spread_images(samples: list[tuple[str, str]], preprocess, count: int) -> tuple[torch.Tensor, list[str]]:
    """(path, class name) samples -> up to ``count`` preprocessed images evenly spread, and their names."""
    from PIL import Image

    named: dict[str, str] = {}
    for path, name in samples:  # local tests may repeat evaluation images: each path once, its first name
        named.setdefault(path, name)
    paths = list(named)
    if len(paths) > count:
        paths = [paths[math.floor(i * len(paths) / count)] for i in range(count)]
    images, names = [], []
    for path in paths:
        try:
            with Image.open(path) as image:
                images.append(preprocess(image.convert("RGB")))
        except Exception:  # noqa: BLE001 - PIL raises many types; a broken file just is not used
            continue
        names.append(named[path])
    return (torch.stack(images) if images else torch.zeros(0)), names


def images_folder(folder: str | Path | None) -> Path | None:
    """``--images`` checked before any heavy work: a directory, or None when not given."""
    if folder is not None and not Path(folder).is_dir():
        raise ExportError(f"{folder}: --images needs a directory of images")
    return Path(folder) if folder is not None else None


def folder_images(folder: Path, preprocess, count: int) -> tuple[torch.Tensor, list[str]]:
    """Up to ``count`` preprocessed images of ``folder`` (``--images``: walked recursively, evenly spread),
    each named by its parent folder (FOLDER/<class>/<image>, as `edge-client train` reads labels)."""
    from edge_client.images import ImageReadError, iter_image_paths

    try:
        paths = [str(p) for p in iter_image_paths([folder])]
    except ImageReadError as err:
        raise ExportError(f"{folder}: --images: {err}") from None
    images, names = _spread_images([(p, Path(p).parent.name) for p in paths], preprocess, count)
    if not len(images):
        raise ExportError(f"{folder}: --images holds no readable image")
    return images, names


def synthetic_images(count: int, image_size: int, seed: int = 0) -> torch.Tensor:
    """Deterministic normalised noise images (tops up parity when the run's data is short)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, 3, image_size, image_size, generator=generator)


def topped_up(images: torch.Tensor, image_size: int, seed: int) -> torch.Tensor:
    """Real images, with noise images added only up to parity's minimum: noise has near-tied
    logits, so more of it would only make the fp16/int8 agreement meaningless."""
    images = images.reshape(-1, 3, image_size, image_size)
    missing = max(0, MIN_IMAGES - len(images))
    return torch.cat([images, synthetic_images(missing, image_size, seed=seed)]) if missing else images


# ---- which images judge parity and calibrate int8 ----------------------------------------------
@dataclass
class ExportImages:
    """Parity images (at least ``MIN_IMAGES``), int8 calibration images (None: the parity ones), the
    manifest's note of where they came from, and the one warning line when generated pixels stand in."""

    parity: torch.Tensor
    calibration: torch.Tensor | None
    note: dict[str, int]
    warning: str | None = None
    labels: np.ndarray | None = None  # per parity image: its class's index in ``class_names``, -1 unknown
    unlabelled: str | None = None  # int8: why its accuracy bound cannot be held (the one warning line)
    calibration_real: int = 0  # int8: how many calibration images are real (static int8 needs some)


def export_images(run: RunDir, preprocess, image_size: int, count: int, folder: Path | None,
                  int8: bool, class_names: list[str] | None = None) -> ExportImages:
    """Parity on ``folder`` (``--images``) when given, else on the run's test images where they are
    reachable (rebuilt from the recorded preset, ``RunDir.federation``), else on generated pixels.
    int8 calibration: the run's training images where reachable, else ``folder``'s, else generated.
    A machine holding the run alone gets generated pixels and one warning line saying so.
    ``class_names``: the bundle's classes; each parity image whose class is one of them gets its index
    as label (``ExportImages.labels``), the task accuracy int8 holds (export/int8.py)."""
    federation, reason = None, "no readable image"
    if folder is None or int8:  # the run's images are asked for only where they are used
        try:
            federation = run.federation()
        except RunError as err:
            reason = str(err)
    if folder is not None:
        (real, names), kind, source = folder_images(folder, preprocess, count), "folder", str(folder)
    else:
        real, names = run_images(federation, preprocess, count) if federation else (torch.zeros(0), [])
        kind, source = "run", "the run's test images"
    parity_images = topped_up(real, image_size, seed=0)
    generated = len(parity_images) - len(real)
    said = [_said("parity", len(real), generated, source, reason)]
    calibration, calibration_real = None, len(real)  # None: the parity images calibrate
    if int8:
        train = run_training_images(federation, preprocess, count) if federation else torch.zeros(0)
        if len(train) or folder is None:  # the run's training images (another seed for any top-up)
            calibration, calibration_real = topped_up(train, image_size, seed=1), len(train)
            said.append(_said("int8 calibration", len(train), len(calibration) - len(train),
                              "the run's training images", reason))
    parts = [s for s in said if s]
    hint = "" if folder is not None else "; pass --images DIR for real ones"
    index = {name: i for i, name in enumerate(class_names or [])}
    labels = np.array([index.get(name, -1) for name in names] + [-1] * generated, dtype=np.int64)
    unlabelled = None
    if int8 and class_names is not None and int(np.sum(labels >= 0)) < MIN_IMAGES:
        why = (f"{folder} holds no {MIN_IMAGES} images in <class>/ folders of the bundle's classes" if folder
               else f"the run's test images are not reachable ({reason})" if not len(real)
               else "the run's test images are not of the bundle's classes")
        unlabelled = (f"int8: fewer than {MIN_IMAGES} labelled held-out images ({why}); layers kept fp32 by top-1 "
                      f"agreement with fp32 instead of --max-accuracy-drop")
    return ExportImages(parity_images, calibration, {kind: len(real), "synthetic": generated},
                        "; ".join(parts) + hint if parts else None, labels, unlabelled,
                        calibration_real if int8 else 0)


def _said(purpose: str, real: int, generated: int, source: str, reason: str) -> str | None:
    """What one purpose's generated images stand in for (None: none generated)."""
    if not generated:
        return None
    if not real:
        return f"{purpose} on {generated} generated images ({source} not reachable: {reason})"
    return f"{purpose} on {real} of {source} and {generated} generated images (fewer than {MIN_IMAGES})"
