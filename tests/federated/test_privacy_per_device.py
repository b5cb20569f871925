"""Privacy per device (docs/howto/privacy.md, "One device, one participant"): under ``[privacy]``, `fedmvp ingest`
takes one update per device (its files' ``device_id``) per release, refuses a file that names no device, and
the epsilon a device spent, recomputed from the run's records with dp-accounting, is the one the run reports.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedmvp.federated.ingest import ingest
from fedmvp.federated.privacy_budget import epsilon
from fedmvp.runs import RunDir
from fedmvp_formats.bundle_manifest import DEVICE_ID_FILE
from fedmvp_formats.privacy import PrivacyRecord
from tests.federated.test_ingest import (SERVER, base_run, configure, good_update, lora_of, raw_update,  # noqa: F401
                                         run)

PHONE, TABLET = "a1" * 16, "b2" * 16
DELTA = 1e-5


def _private(run, **settings) -> PrivacyRecord:
    record = PrivacyRecord(**{"clip_norm": 0.05, "noise_multiplier": 1.0, "max_epsilon": None, **settings})
    RunDir(run).write_config({**RunDir(run).read_config(), "privacy": record.record()})
    return record


def _device_epsilon(run, device: str) -> tuple[float, list[int]]:
    """Epsilon of the releases ``device`` took part in, from state.json alone (each release's recorded
    (q, z), once per release), and how many of its files each release took."""
    events, counts = [], []
    for round_number in RunDir(run).rounds():
        state = RunDir(run).load_checkpoint(round_number).state
        taken = [r for r in state.get("ingest", []) if r["accepted"] and r["device_id"] == device]
        if taken:
            counts.append(len(taken))
            events.append((float(state["privacy"]["sampling_rate"]), float(state["privacy"]["noise_multiplier"])))
    return epsilon(events, DELTA), counts


@pytest.mark.parametrize("mode", ["central", "local"])
def test_one_update_per_device_a_release_and_the_devices_epsilon_recomputed(run, tmp_path, mode):
    settings = _private(run, mode=mode)
    lora = lora_of(run)
    older = good_update(tmp_path / "phone-1.st", lora, 0.01, 10, 1.0, device_id=PHONE, created="2026-01-01T00:00:00Z")
    newer = good_update(tmp_path / "phone-2.st", lora, 0.02, 10, 1.0, device_id=PHONE, created="2026-01-02T00:00:00Z")
    other = good_update(tmp_path / "tablet.st", lora, -0.01, 10, 1.0, device_id=TABLET)
    result = ingest(run, [newer, other, older])
    assert sorted(v.file for v in result.accepted) == sorted([str(newer), str(other)])
    (refused,) = result.rejected
    assert refused.file == str(older) and refused.reason.startswith(f"device {PHONE[:12]}")
    assert "a device is one participant of a release" in refused.reason and "\n" not in refused.reason
    state = RunDir(run).load_checkpoint(3).state
    if mode == "central":
        assert state["privacy"]["participants"] == 2  # two devices, not three files
    spent, counts = _device_epsilon(run, PHONE)
    assert counts == [1]
    assert spent == pytest.approx(state["privacy"]["epsilon"], rel=1e-12)
    assert spent == pytest.approx(epsilon([(1.0, settings.noise_multiplier)], DELTA), rel=1e-12)
    # what it would have spent with both files in: twice the sensitivity, half the noise per unit of it
    assert epsilon([(1.0, settings.noise_multiplier / 2)], DELTA) > 2 * spent

    configure(run, {**SERVER, "max_staleness": 1})
    again = ingest(run, [older])  # a later release may take it, and charges it again
    assert again.round == 4 and [v.file for v in again.accepted] == [str(older)]
    spent, counts = _device_epsilon(run, PHONE)
    assert counts == [1, 1]
    assert spent == pytest.approx(RunDir(run).load_checkpoint(4).state["privacy"]["epsilon"], rel=1e-12)


def test_a_file_naming_no_device_is_refused_only_under_privacy(run, tmp_path):
    lora = lora_of(run)
    from safetensors.numpy import load_file, save_file
    from safetensors import safe_open

    anonymous = good_update(tmp_path / "anon.st", lora, 0.01, 10, 1.0)
    with safe_open(str(anonymous), "np") as f:  # an older client's file: no device_id
        metadata = {k: v for k, v in f.metadata().items() if k != "device_id"}
    save_file(load_file(str(anonymous)), str(anonymous), metadata=metadata)
    _private(run, mode="central")
    result = ingest(run, [anonymous])
    assert result.round is None and result.rejected[0].reason.startswith("no device_id: under [privacy]")
    RunDir(run).write_config({k: v for k, v in RunDir(run).read_config().items() if k != "privacy"})
    assert ingest(run, [anonymous]).round == 3


@pytest.mark.parametrize("value", ["A1" * 16, "a1" * 15, "a1" * 16 + "00", "device-1", ""])
def test_a_malformed_device_id_is_refused_by_the_format(run, tmp_path, value):
    lora = lora_of(run)
    path = raw_update(tmp_path / "bad.st", {k: v + 0.01 for k, v in lora.items()}, device_id=value)
    result = ingest(run, [path])
    assert result.round is None and "device_id" in result.rejected[0].reason
    assert "is not 32 hex digits" in result.rejected[0].reason


def test_a_bundle_keeps_its_device_id_from_the_first_update_written(tmp_path):
    from safetensors import safe_open

    from edge_client.device_id import device_id
    from tests.federated.test_ingest import bundle_for

    lora = {"lora.a": np.zeros((2, 3), np.float32)}
    bundle = bundle_for(tmp_path / "bundle", lora)
    assert not (bundle.path / DEVICE_ID_FILE).exists()
    ids = []
    for i in range(2):
        from edge_client.update import write_update

        path = write_update(tmp_path / f"u{i}.st", {"lora.a": lora["lora.a"] + i + 1}, bundle=bundle,
                            num_examples=3, mean_loss=1.0)
        with safe_open(str(path), "np") as f:
            ids.append(f.metadata()["device_id"])
    assert ids[0] == ids[1] == device_id(bundle.path) == (bundle.path / DEVICE_ID_FILE).read_text().strip()
    other = bundle_for(tmp_path / "other", lora)
    assert device_id(other.path) != ids[0]  # another bundle directory is another device
    (bundle.path / DEVICE_ID_FILE).write_text("not an id\n")
    from edge_client.device_id import DeviceIdError

    with pytest.raises(DeviceIdError, match=r"device-id: not a device id \(32 hex digits\)"):
        device_id(bundle.path)
