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
    from export.bundle_writer import ExportOptions, export_bundle

    out = tmp_path_factory.mktemp("edge-bundles") / "fp32"
    return export_bundle(edge_run, 2, out, ExportOptions(parity_images=32)).path


@pytest.fixture(scope="session")
def moved_run(edge_run) -> Path:
    """A run beside ``edge_run`` (same data) whose round 2 PromptFormer and LoRA differ from round 1's."""
    root = edge_run.parents[1]
    run = root / "runs" / "edgetest-moved"
    write_run(run, root / "preset.toml", moved=True)
    return run


@pytest.fixture(scope="session")
def moved_bundles(moved_run, tmp_path_factory) -> dict[int, Path]:
    """fp32 bundles of rounds 1 and 2 of ``moved_run`` (what a refresh moves between). Read-only."""
    from export.bundle_writer import ExportOptions, export_bundle

    out = tmp_path_factory.mktemp("moved-bundles")
    return {r: export_bundle(moved_run, r, out / f"round-{r}", ExportOptions(parity_images=32)).path for r in (1, 2)}


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


@pytest.fixture(autouse=True)
def _no_runtime_switched_off_after():
    """A device command switches runtimes off for its process; a test's CliRunner call must not leave that
    to the next test."""
    yield
    from edge_client.engines import disable_runtimes

    disable_runtimes("", "")
