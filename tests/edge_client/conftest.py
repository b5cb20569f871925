"""Session fixtures for the edge-client tests: one tiny run, one exported bundle (built once)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from edge_helpers import write_dataset, write_preset, write_run


@pytest.fixture(scope="session")
def edge_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("edge-run")
    write_dataset(root / "data")
    write_preset(root / "preset.toml", root / "data")
    run = root / "runs" / "edgetest-1"
    write_run(run, root / "preset.toml")
    return run


@pytest.fixture(scope="session")
def edge_bundle(edge_run, tmp_path_factory) -> Path:
    """fp32 bundle of round 2, exported with the exporter's Python API. Treat as read-only."""
    from export.bundle_writer import export_bundle

    out = tmp_path_factory.mktemp("edge-bundles") / "fp32"
    return export_bundle(edge_run, 2, out, parity_images=32).path


@pytest.fixture
def bundle_dir(edge_bundle, tmp_path) -> Path:
    """A private copy of the bundle that a test may personalise or damage."""
    target = tmp_path / "bundle"
    shutil.copytree(edge_bundle, target)
    return target


@pytest.fixture(scope="session")
def data_root(edge_run) -> Path:
    return edge_run.parents[1] / "data"


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The tiny model is faster on one thread, and the test machine's cores are shared."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
