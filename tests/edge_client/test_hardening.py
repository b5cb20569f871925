"""Hostile-input fixes of edge_client, in process: write targets, concurrent personalisation,
manifest integrity, update metadata, local data, non-UTF-8 names, malformed state."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from edge_helpers import tree_bytes, write_local_data

from edge_client.bundle import read_bundle
from edge_client.train import train_local
from edge_client.train_options import TrainInputError

LOCAL_CLASSES = ["purple_cross", "orange_ring"]


@pytest.fixture
def local(tmp_path) -> Path:
    return write_local_data(tmp_path / "local", LOCAL_CLASSES, per_class=2)


# ---- 1: no output inside a bundle or run, no overwriting ------------------------------------------------
@pytest.mark.parametrize("where", ["weights.safetensors", "personalised/x.safetensors", "sub/dir"])
def test_out_inside_a_bundle_is_refused_before_training(bundle_dir, local, where):
    before = tree_bytes(bundle_dir)
    with pytest.raises(TrainInputError, match="inside a fedmvp bundle"):
        train_local(local, bundle_dir, out=bundle_dir / where, epochs=1)
    assert tree_bytes(bundle_dir) == before


def test_out_through_a_symlink_into_a_bundle_is_refused(bundle_dir, local, tmp_path):
    (tmp_path / "link").symlink_to(bundle_dir)
    with pytest.raises(TrainInputError, match="inside a fedmvp bundle"):
        train_local(local, bundle_dir, out=tmp_path / "link" / "u.safetensors", epochs=1)


def test_out_inside_a_run_directory_is_refused(bundle_dir, local, edge_run):
    with pytest.raises(TrainInputError, match="inside a fedmvp run directory"):
        train_local(local, bundle_dir, out=edge_run / "updates", epochs=1)


def test_existing_out_file_is_never_overwritten(bundle_dir, local, tmp_path):
    target = tmp_path / "mine.safetensors"
    target.write_bytes(b"precious")
    with pytest.raises(TrainInputError, match="already exists"):
        train_local(local, bundle_dir, out=target, epochs=1)
    assert target.read_bytes() == b"precious"
