"""The buffered server's keys (fedmvp/presets/server.py); its update rule is aggregate.py's, tested in
test_staleness.py, and its loop in test_buffered.py (real processes)."""

from __future__ import annotations

import pytest

from fedmvp.presets.server import ServerRecordError, ServerSpec


@pytest.mark.parametrize("key,value,message", [
    ("mode", "async", "mode must be 'sync' or 'buffered'"),
    ("concurrency", 0, "concurrency and buffer_size must be at least 1"),
    ("buffer_size", 0, "concurrency and buffer_size must be at least 1"),
])
def test_buffered_server_keys_are_range_checked(key, value, message):
    with pytest.raises(ServerRecordError, match=message):
        ServerSpec().with_overrides({key: value}, "preset.toml")


def test_a_simulation_refuses_buffered_mode_in_one_line(tmp_path, preset_file):
    from fedmvp.federated.prepare import prepare_run
    from fedmvp.federated.simulation import simulate
    from fedmvp.runs import RunError

    preset_file.write_text(preset_file.read_text() + "\n[server]\nmode = \"buffered\"\n")
    with pytest.raises(RunError, match="mode = 'buffered' trains on edge devices"):  # before the run is written
        prepare_run(str(preset_file), str(tmp_path / "run"), 1, resume=False, device="cpu")
    assert not (tmp_path / "run").exists()
    # a deployment's run (`fedmvp serve` writes it without the sites' data), then `fedmvp train --resume` on it
    run = prepare_run(str(preset_file), str(tmp_path / "run"), 1, resume=False, device="cpu", with_data=False)
    with pytest.raises(RunError, match="mode = 'buffered' trains on edge devices"):
        simulate(run)
