"""The hostile-bundle tables share one exported bundle per session (an export takes about 15 s)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "edge_client"))


@pytest.fixture(scope="session")
def pristine_bundle(tmp_path_factory) -> Path:
    """One fp32 bundle of a tiny run's round 2; read-only: every row attacks its own copy."""
    from edge_helpers import write_dataset, write_preset, write_run

    from export.bundle_writer import ExportOptions, export_bundle

    root = tmp_path_factory.mktemp("hostile-bundle")
    write_dataset(root / "data", per_class=4)
    write_preset(root / "preset.toml", root / "data")
    write_run(root / "runs" / "edgetest-1", root / "preset.toml")
    return export_bundle(root / "runs" / "edgetest-1", 2, root / "bundle", ExportOptions(parity_images=32)).path
