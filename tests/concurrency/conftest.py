"""Fixtures of the concurrency tests: one tiny run and one exported bundle per session (tests copy them)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.edge_client.edge_helpers import CLASSES, write_dataset, write_local_data, write_preset, write_run


@pytest.fixture(scope="session")
def world(tmp_path_factory) -> Path:
    """data/, preset.toml and runs/moved (rounds 1 and 2; round 2's PromptFormer and LoRA moved on)."""
    root = tmp_path_factory.mktemp("concurrency")
    write_dataset(root / "data", per_class=4)
    write_preset(root / "preset.toml", root / "data")
    write_run(root / "runs" / "moved", root / "preset.toml", moved=True)
    write_local_data(root / "local", CLASSES[:2], per_class=2)
    return root


@pytest.fixture(scope="session")
def exported(world) -> Path:
    """The fp32 bundle of round 1 (refreshable, trainable). Read-only: tests copy it."""
    from export.bundle_writer import ExportOptions, export_bundle

    return export_bundle(world / "runs" / "moved", 1, world / "bundle-r1", ExportOptions(parity_images=32)).path


@pytest.fixture
def bundle(exported, tmp_path) -> Path:
    shutil.copytree(exported, tmp_path / "bundle")
    return tmp_path / "bundle"
