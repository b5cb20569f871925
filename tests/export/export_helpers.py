"""Helpers of the export tests: a tiny fedmvp run on disk, built without Flower."""

from __future__ import annotations

from pathlib import Path

import torch

NUM_CLASSES = 12
SYNTHETIC = Path(__file__).resolve().parents[2] / "fedmvp" / "weights" / "fedmvp-tiny-synthetic.safetensors"


def pretrained_tag() -> str:
    """The shipped synthetic weights when present (meaningful logits), else random init."""
    return "synthetic" if SYNTHETIC.is_file() else ""


def write_dataset(root: Path) -> None:
    """A small synthetic world (photo domain): shapes the tiny CLIP was pretrained to recognise."""
    from fedmvp.synthetic.writer import write_world

    write_world(root, seed=0, counts={"train": 2, "test": 6}, domains=["photo"], workers=1)


def write_preset(path: Path, data_root: Path) -> None:
    """Base-to-new over 8 base classes (2 clients) and 4 new ones: 12 classes, 72 test images."""
    path.write_text(f"""
name = "exporttest"
protocol = "base-to-new"
seed = 0
[model]
clip = "fedmvp-tiny"
pretrained = "{pretrained_tag()}"
[train]
rounds = 2
batch_size = 16
shots = 2
[[datasets]]
name = "shapes"
layout = "synthetic"
root = "{data_root}"
attributes = "attributes.json"
train_split = "train"
test_split = "test"
train_domains = ["photo"]
base_classes = 8
new_classes = 4
classes_per_client = 4
""")


def write_run(run_path: Path, preset: Path, seed: int = 0,
              lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v"), classes: bool = True) -> None:
    """config.json (+ classes.json unless ``classes=False``) + rounds 1 and 2; LoRA B perturbed so LoRA
    changes the outputs."""
    from tests.run_fixtures import write_run as shared

    shared(run_path, preset, pretrained_tag(), "exporttest", seed, lora_targets=lora_targets, classes=classes)


def tiny_run_in(root: Path, name: str = "exporttest-1") -> Path:
    """The dataset, the preset and a run of it under ``root``: RUN, as ``fedmvp train`` would leave it."""
    write_dataset(root / "data")
    write_preset(root / "preset.toml", root / "data")
    write_run(root / "runs" / name, root / "preset.toml")
    return root / "runs" / name


def rebuilt_model(run_path: Path, round_number: int = 2):
    """The PyTorch model exactly as the exporter rebuilds it: (model, clip)."""
    from tests.run_fixtures import rebuilt_model as shared

    return shared(run_path, round_number)
