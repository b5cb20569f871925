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


# ---- 2: concurrent personalisation --------------------------------------------------------------------
_APPLY = """
import sys
from edge_client.bundle import read_bundle
from edge_client.lora_store import apply_update
bundle = read_bundle(sys.argv[1])
for path in sys.argv[2:]:
    apply_update(bundle, path, keep=1000)
"""


def test_concurrent_applies_lose_nothing_and_every_entry_verifies(bundle_dir, tmp_path):
    import subprocess
    import sys

    import numpy as np

    from edge_client.lora_store import _load_entry, read_state
    from edge_client.update import write_update

    bundle = read_bundle(bundle_dir)
    base = bundle.lora()
    workers, each = 4, 4
    batches = []
    for w in range(workers):
        paths = []
        for i in range(each):
            tensors = {k: v + np.float32(0.001 * (w * each + i + 1)) for k, v in base.items()}
            paths.append(str(write_update(tmp_path / f"u{w}-{i}.safetensors", tensors, bundle=bundle,
                                          num_examples=1, mean_loss=1.0)))
        batches.append(paths)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", _APPLY, str(bundle_dir), *paths], env=env,
                              stderr=subprocess.PIPE, text=True) for paths in batches]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    state = read_state(bundle)
    entries = [state["active"], *state["history"]]
    assert len(entries) == workers * each and state["next"] == workers * each + 1
    assert len({e["file"] for e in entries}) == workers * each
    assert sorted(Path(e["update"]["source"]).name for e in entries) == sorted(
        Path(p).name for paths in batches for p in paths)
    for entry in entries:
        _load_entry(bundle, entry)  # size, sha256, update metadata
    leftovers = [p.name for p in (bundle_dir / "personalised").iterdir() if p.name.endswith(".tmp")]
    assert not leftovers
