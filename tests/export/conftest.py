"""Fixtures of the export tests: the tiny run and one exported fp32 bundle shared by the tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from export_helpers import tiny_run_in


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    return tiny_run_in(tmp_path_factory.mktemp("export-run"))


@pytest.fixture(scope="session")
def tiny_bundle(tiny_run, tmp_path_factory):
    """fp32 bundle of round 2 (BundleResult)."""
    from export.bundle_writer import export_bundle

    out = tmp_path_factory.mktemp("bundles") / "fp32"
    return export_bundle(tiny_run, 2, out)


@pytest.fixture
def run_copy(tiny_run, tmp_path) -> Path:
    """A private copy of the run that a test may damage."""
    target = tmp_path / "runs" / tiny_run.name
    shutil.copytree(tiny_run, target)
    return target
