"""A small synthetic world and a preset over it, shared by the federated tests."""

from __future__ import annotations

from pathlib import Path

import pytest

PRESET = """
name = "fedtest"
protocol = "base-to-new"
seed = 3

[model]
clip = "fedmvp-tiny"
pretrained = ""

[train]
rounds = 3
local_epochs = 1
batch_size = 4
shots = 2
sigma = {sigma}
lora_rank = 4
alpha = 5.0

[[datasets]]
name = "shapes"
layout = "synthetic"
root = "{root}"
train_domains = ["photo"]
test_domains = ["painting"]
base_classes = 4
new_classes = 2
classes_per_client = 2
"""


@pytest.fixture(scope="session")
def small_world(tmp_path_factory) -> Path:
    from fedmvp.synthetic.writer import write_world

    return write_world(tmp_path_factory.mktemp("world") / "world", counts={"train": 2, "test": 2},
                       domains=["photo", "painting"])


def write_preset(folder: Path, world: Path, sigma: float = 1000.0) -> Path:
    """sigma 1000: every client switches to LoRA after round 1, so both upload kinds are exercised.
    lora_rank 4 and alpha 5 (not the defaults 8 and 10): tests see them reach the weights and the edge."""
    path = folder / "fedtest.toml"
    path.write_text(PRESET.format(root=world, sigma=sigma))
    return path


@pytest.fixture
def preset_file(tmp_path, small_world) -> Path:
    return write_preset(tmp_path, small_world)


def three_site_preset(folder: Path, world: Path, rounds: int = 2) -> Path:
    """The same preset cut into three sites (6 base classes, 2 per site, no new classes)."""
    path = write_preset(folder, world)
    text = path.read_text().replace("rounds = 3", f"rounds = {rounds}").replace("base_classes = 4", "base_classes = 6")
    path.write_text(text.replace("new_classes = 2", "new_classes = 0"))
    return path


@pytest.fixture(scope="session")
def world6(tmp_path_factory) -> Path:
    from fedmvp.synthetic.writer import write_world

    return write_world(tmp_path_factory.mktemp("world6") / "world", counts={"train": 2, "test": 2},
                       domains=["photo", "painting"])
