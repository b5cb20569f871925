"""[privacy] end to end on a real bundle: the exporter writes the run's settings and epsilon into the
manifest, `edge-client train` learns them there and clips (local: noises) its delta before anything is
written, `fedmvp ingest` charges the round, and the next export reports dp-accounting's epsilon.
Each check is on weights: the delta the device sends, the LoRA the run writes."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from edge_helpers import LORA, write_local_data


def _private_run(edge_run, tmp_path, **settings):
    from fedmvp.runs import RunDir
    from fedmvp_formats.privacy import PrivacyRecord

    run = tmp_path / "run"
    shutil.copytree(edge_run, run)
    config = RunDir(run).read_config()
    RunDir(run).write_config({**config, "privacy": PrivacyRecord(**settings).record()})
    return run


def _norm(a: dict, b: dict) -> float:
    return float(np.sqrt(sum(np.sum((a[k].astype(np.float64) - b[k]) ** 2) for k in a)))


@pytest.mark.parametrize("mode", ["central", "local"])
def test_a_device_trains_under_the_manifests_privacy_and_the_run_accounts_for_it(edge_run, tmp_path, mode):
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    from edge_client.bundle import read_bundle
    from edge_client.train import train_local
    from export.bundle_writer import ExportOptions, export_bundle
    from fedmvp.federated.ingest import ingest

    run = _private_run(edge_run, tmp_path, clip_norm=0.01, noise_multiplier=0.8, mode=mode, max_epsilon=None)
    bundle = read_bundle(export_bundle(run, 2, tmp_path / "bundle", ExportOptions(parity_images=32)).path)
    section = bundle.manifest["privacy"]
    # round 2 added no noise: the manifest claims no epsilon for it (docs/howto/privacy.md)
    assert (section["clip_norm"], section["mode"], section["epsilon"], section["dp_rounds"]) == (0.01, mode, None, 0)
    start = {k: v.copy() for k, v in bundle.lora().items()}

    data = write_local_data(tmp_path / "local", ["red_circle", "blue_square"], per_class=3)
    result = train_local(data, bundle.path, epochs=2, batch_size=6, lr=0.5, threads=1, start="bundle",
                         out=tmp_path / "updates", seed=1)
    assert result.privacy["mode"] == mode and result.privacy["delta_norm"] > 0.01  # it trained past C
    sent = result.tensors
    assert any(not np.array_equal(sent[k], start[k]) for k in LORA)  # the LoRA changed under DP
    if mode == "central":  # the device's clip alone bounds what it sends
        assert _norm(sent, start) <= 0.01 * (1 + 1e-4)
    else:  # its own noise, N(0, (z C)^2) per coordinate, dominates the clipped delta
        size = sum(v.size for v in start.values())
        assert _norm(sent, start) == pytest.approx(0.8 * 0.01 * np.sqrt(size), rel=0.2)

    ingest(run, [result.update_path])
    exported = read_bundle(export_bundle(run, 3, tmp_path / "bundle-3", ExportOptions(parity_images=32)).path)
    accountant = RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(0.8))  # one round, q = 1 (an ingest samples no one)
    assert exported.manifest["privacy"]["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    assert exported.manifest["privacy"]["dp_rounds"] == 1
    assert exported.privacy.clip_norm == 0.01
    assert _norm(exported.lora(), start) > 0  # the round moved the LoRA


def test_a_bundle_without_privacy_trains_as_before(edge_bundle, tmp_path):
    from edge_client.bundle import read_bundle
    from edge_client.train import train_local

    path = tmp_path / "bundle"
    shutil.copytree(edge_bundle, path)
    assert read_bundle(path).privacy is None and "privacy" not in read_bundle(path).manifest
    data = write_local_data(tmp_path / "local", ["red_circle", "blue_square"], per_class=2)
    result = train_local(data, path, epochs=1, batch_size=4, lr=0.5, threads=1, start="bundle", out=None)
    assert result.privacy is None and _norm(result.tensors, read_bundle(path).lora()) > 0.01
