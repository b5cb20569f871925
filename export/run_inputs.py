"""What an export reads from a run: its directory, the round's checkpoint and method record,
the CLIP's preprocessing, and the run's data (class set and parity / calibration images).

Kept apart from the writer so the export core can be driven with explicit arguments (a model,
a class set, images) and this layer stays thin: find the run, rebuild the model by the one rebuild
(``FedMVP.from_run``: the round's method record + its tensors, never defaults or tensor shapes),
take the class set and images from the run's federation (``RunDir.federation``, once per process).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from edge_client.preprocess import PreprocessSpec
from export.errors import ExportError
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
        if not (path / "config.json").is_file():
            raise ExportError(f"{path}: not a fedmvp run (no config.json)")
        return RunDir(path)
    candidates = [p for p in runs_root.glob("*") if (p / "config.json").is_file()] if runs_root.is_dir() else []
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


def run_federation(run: RunDir):
    """The run's Federation from its recorded preset (``RunDir.federation``: once per process)."""
    try:
        return run.federation()
    except RunError as err:
        raise ExportError(str(err)) from None


def run_images(federation, preprocess, count: int) -> torch.Tensor:
    """Up to ``count`` preprocessed test images, evenly spread over the run's evaluation sets.

    Unreadable files are skipped (the caller tops up with synthetic images)."""
    samples = [s for e in federation.evaluations for s in e.samples]
    samples += [s for c in federation.clients for s in c.test]
    return _spread_images([path for path, _ in samples], preprocess, count)


def run_training_images(federation, preprocess, count: int) -> torch.Tensor:
    """Up to ``count`` preprocessed training images of the run's clients (int8 calibration: kept
    apart from the test images that the parity check then judges on)."""
    return _spread_images([path for c in federation.clients for path, _ in c.train], preprocess, count)


def _spread_images(paths: list[str], preprocess, count: int) -> torch.Tensor:
    from PIL import Image

    paths = list(dict.fromkeys(paths))  # local tests may repeat evaluation images
    if len(paths) > count:
        paths = [paths[math.floor(i * len(paths) / count)] for i in range(count)]
    images = []
    for path in paths:
        try:
            with Image.open(path) as image:
                images.append(preprocess(image.convert("RGB")))
        except Exception:  # noqa: BLE001 - PIL raises many types; a broken file just is not used
            continue
    return torch.stack(images) if images else torch.zeros(0)


def synthetic_images(count: int, image_size: int, seed: int = 0) -> torch.Tensor:
    """Deterministic normalised noise images (tops up parity when the run's data is short)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, 3, image_size, image_size, generator=generator)
