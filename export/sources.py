"""What an export reads: the run directory, its checkpoint, class set, preprocessing and images.

Kept apart from the writer so the export core can be driven with explicit arguments (a model,
a class set, images) and this layer stays thin: find the run, rebuild the model from
config.json + the round's tensors, take the class set (base then new classes of every
dataset) and parity images from the run's preset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from edge_client.preprocess import PreprocessSpec
from fedmvp.attributes.sentences import SentenceStyle, build_sentences
from fedmvp.clip import LoadedClip
from fedmvp.model import LORA_PREFIX, PROMPTFORMER_PREFIX, FedMVP, FedMVPConfig
from fedmvp.runs import Checkpoint, RunDir, RunError


class ExportError(RuntimeError):
    """Bad input for an export (missing run or round, corrupt file, bad class set); one line."""


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
    try:
        config = run.read_config()
    except RunError as err:
        raise ExportError(str(err)) from None
    if not isinstance(config.get("model"), dict) or "clip" not in config["model"]:
        raise ExportError(f"{run.config_path}: no model.clip entry")
    return config


def load_checkpoint(run: RunDir, round_number: int | None) -> Checkpoint:
    try:
        return run.load_checkpoint(round_number)
    except RunError as err:
        raise ExportError(str(err)) from None


def model_config(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> FedMVPConfig:
    """FedMVPConfig of the run; LoRA presence and rank are read off the checkpoint itself."""
    train = config.get("train") or {}
    lora_a = [v for k, v in tensors.items() if k.startswith(LORA_PREFIX) and "lora_A" in k]
    defaults = FedMVPConfig()
    return FedMVPConfig(num_prompts=int(train.get("num_prompts", defaults.num_prompts)),
                        alpha=float(train.get("alpha", defaults.alpha)),
                        use_lora=bool(lora_a) or bool(train.get("use_lora", defaults.use_lora)),
                        lora_rank=int(lora_a[0].shape[0]) if lora_a else int(train.get("lora_rank", 8)))


def rebuild_model(clip: LoadedClip, config: FedMVPConfig, checkpoint: Checkpoint, where: Path) -> FedMVP:
    """Frozen CLIP + PromptFormer (+ LoRA) with the round's tensors loaded."""
    model = FedMVP(clip, config)
    try:
        missing = model.load_state(checkpoint.tensors)
    except (KeyError, ValueError) as err:
        raise ExportError(f"{where}: checkpoint does not fit {clip.name}: {str(err).strip(chr(39))}") from None
    lacking = [m for m in missing if m.startswith(PROMPTFORMER_PREFIX)]
    if lacking:
        raise ExportError(f"{where}: checkpoint lacks {len(lacking)} PromptFormer tensors "
                          f"(first: {lacking[0]})")
    return model.eval()


def run_federation(config: dict[str, Any], run: RunDir):
    """The run's preset turned into a Federation (None if the preset cannot be read)."""
    from fedmvp.data.federation import build_federation
    from fedmvp.presets.schema import load_preset

    path = Path(config.get("preset_path") or "")
    if not path.is_file() and (run.path / "preset.toml").is_file():
        path = run.path / "preset.toml"
    try:
        return build_federation(load_preset(path))
    except Exception as err:  # PresetError, missing data roots: say which, one line
        raise ExportError(f"{path}: cannot rebuild the run's data ({str(err).splitlines()[0]})") from None


def run_class_set(federation, source: str) -> ClassSet:
    """Base then new classes of every dataset (deduplicated, first occurrence wins).

    Without base/new evaluations (domain protocols) every evaluated or trained class is taken."""
    evals = [e for e in federation.evaluations if e.kind in ("base", "new")]
    groups = [(e.class_names, e.attributes, e.style) for e in evals]
    if not groups:
        groups = [(e.class_names, e.attributes, e.style) for e in federation.evaluations]
        groups += [(c.class_names, c.attributes, c.style) for c in federation.clients]
    known: dict[str, list[str]] = {}
    for group in [*groups, *((c.class_names, c.attributes, c.style) for c in federation.clients)]:
        for name, phrases in group[1].items():
            known.setdefault(name, list(phrases))
    names: list[str] = []
    styles: dict[str, SentenceStyle] = {}
    for class_names, attrs, style in groups:
        for name in class_names:
            if name not in styles:
                names.append(name)
                styles[name] = style
    k = getattr(getattr(federation.preset, "train", None), "num_attributes", None)
    attributes = {n: known.get(n, [])[:k] if k else known.get(n, []) for n in names}
    return ClassSet(names=names, attributes=attributes, styles=styles, source=source)


def file_class_set(path: Path, domain: str | None = None) -> ClassSet:
    """Any class set from a ``{class: [phrases]}`` file (classes nobody trained on included)."""
    from fedmvp.attributes.files import AttributeFileError, load_attributes

    try:
        attributes = load_attributes(path, k=None)
    except AttributeFileError as err:
        raise ExportError(str(err)) from None
    style = SentenceStyle.for_domain(domain)
    names = list(attributes)
    return ClassSet(names=names, attributes=attributes, styles={n: style for n in names}, source=str(path))


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
