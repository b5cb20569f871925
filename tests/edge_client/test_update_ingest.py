"""A device's update file, written by edge_client on a real bundle, goes through `fedmvp ingest` into
a round that `fedmvp-export` exports again: the edge half and the server half agree on the format."""

from __future__ import annotations

import shutil

import numpy as np


def _run_copy(edge_run, tmp_path, run_id: str | None):
    from fedmvp.runs import RunDir

    run = tmp_path / "run"
    shutil.copytree(edge_run, run)
    config = RunDir(run).read_config()
    config.pop("run_id", None)
    RunDir(run).write_config(config | ({"run_id": run_id} if run_id else {}))
    return run


def test_an_update_is_ingested_into_a_round_that_exports(edge_run, edge_bundle, tmp_path):
    from edge_client.bundle import read_bundle
    from edge_client.update import write_update
    from export.bundle_writer import ExportOptions, export_bundle
    from fedmvp.federated.ingest import ingest

    bundle = read_bundle(edge_bundle)
    run = _run_copy(edge_run, tmp_path, bundle.run_id)
    trained = {k: v + 0.01 for k, v in bundle.lora().items()}
    update = write_update(tmp_path / "u.safetensors", trained, bundle=bundle, num_examples=12, mean_loss=1.25)
    result = ingest(run, [update])
    assert result.round == 3 and result.accepted[0].bundle_id == bundle.id

    exported = read_bundle(export_bundle(run, 3, tmp_path / "bundle-3", ExportOptions(parity_images=32)).path)
    assert exported.round == 3
    for name, value in exported.lora().items():  # one update: its LoRA is the round's
        np.testing.assert_allclose(value, trained[name], rtol=0, atol=1e-7)


def test_the_update_names_the_run_its_bundle_came_from(bundle_dir, edge_run, tmp_path):
    from edge_client.bundle import Bundle, read_bundle
    from fedmvp_formats.bundle_manifest import write_manifest
    from edge_client.update import read_update, write_update
    from fedmvp.federated.ingest import ingest

    plain = read_bundle(bundle_dir)
    manifest = dict(plain.manifest)
    manifest["source"] = {k: v for k, v in manifest["source"].items() if k != "run_id"}
    write_manifest(bundle_dir, manifest)
    without = write_update(tmp_path / "plain.st", plain.lora(), bundle=Bundle(bundle_dir, manifest),
                           num_examples=3, mean_loss=1.0)
    assert "run_id" not in read_update(without).metadata  # optional: older manifests lack it

    manifest["source"] = {**manifest["source"], "run_id": "run-1"}
    write_manifest(bundle_dir, manifest)
    bundle = read_bundle(bundle_dir)
    assert bundle.run_id == "run-1"
    named = write_update(tmp_path / "named.st", bundle.lora(), bundle=bundle, num_examples=3, mean_loss=1.0)
    assert read_update(named, bundle).metadata["run_id"] == "run-1"
    assert "another run" in ingest(_run_copy(edge_run, tmp_path / "a", "run-2"), [named]).files[0].reason
    assert ingest(_run_copy(edge_run, tmp_path / "b", "run-1"), [named]).round == 3
