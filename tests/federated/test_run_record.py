"""A run's settings are its record: config.json keeps the preset's text, and a resume uses that."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
from click.testing import CliRunner

from fedmvp_apps.cli import main
from fedmvp.federated.prepare import prepare_run
from fedmvp.federated.strategy import RoundFailed
from fedmvp.presets.schema import load_preset
from fedmvp.runs import RunDir


def test_resume_uses_the_recorded_preset_and_says_the_file_changed(preset_file, tmp_path, capsys):
    run = prepare_run(str(preset_file), str(tmp_path / "run"), None, False, "cpu")
    config = run.read_config()
    original = preset_file.read_text()
    assert config["preset_text"] == original
    assert config["preset_sha256"] == hashlib.sha256(original.encode()).hexdigest()
    assert run.preset_file() == str(preset_file.resolve())  # unchanged: the original path (deployed clients)
    preset_file.write_text(original.replace("shots = 2", "shots = 1").replace("sigma = 1000.0", "sigma = 0.0"))
    capsys.readouterr()
    resumed = prepare_run(str(preset_file), str(run.path), None, True, "cpu")
    used = resumed.preset_file()
    err = capsys.readouterr().err
    assert err.count("changed since the run started") == 1 and err.startswith("warning: ")
    assert used == str(run.path / "preset.toml")
    preset = load_preset(used)  # what the server and clients of the resumed rounds load
    assert (preset.train.shots, preset.train.sigma) == (2, 1000.0)
    assert preset.datasets[0].root_path() == load_preset(preset_file).datasets[0].root_path()


def test_relative_roots_of_the_recorded_copy_resolve_from_the_preset_folder(preset_file, small_world, tmp_path):
    relative = os.path.relpath(small_world, preset_file.parent)
    preset_file.write_text(preset_file.read_text().replace(f'root = "{small_world}"', f'root = "{relative}"'))
    run = prepare_run(str(preset_file), str(tmp_path / "run"), None, False, "cpu")
    copy = load_preset(run.path / "preset.toml")
    assert copy.datasets[0].root_path().resolve() == small_world.resolve()


def test_resume_with_another_preset_is_refused(preset_file, tmp_path):
    run = prepare_run(str(preset_file), str(tmp_path / "run"), None, False, "cpu")
    other = tmp_path / "other.toml"
    other.write_text(preset_file.read_text().replace("shots = 2", "shots = 1"))
    before = run.config_path.read_bytes()
    result = CliRunner().invoke(main, ["train", "--resume", "--config", str(other), "--run-dir", str(run.path)])
    assert result.exit_code == 2, result.output
    assert "not the preset" in result.output and len(result.output.strip().splitlines()) == 1
    assert run.config_path.read_bytes() == before


def test_an_old_run_without_the_record_falls_back_with_a_warning(preset_file, tmp_path, capsys):
    run = prepare_run(str(preset_file), str(tmp_path / "run"), None, False, "cpu")
    config = run.read_config()
    del config["preset_text"]
    RunDir(run.path).write_config(config)
    assert run.preset_file() == config["preset_path"]
    assert "no recorded preset text" in capsys.readouterr().err
    json.loads(run.config_path.read_text())


@pytest.mark.parametrize("failure,line", [
    (OSError(28, "No space left on device", "/runs/x/round-0002"), "/runs/x/round-0002: No space left on device"),
    (RoundFailed("round 2: the training loss is nan; the run stops"), "round 2: the training loss is nan"),
])
def test_a_server_failure_stops_train_with_its_one_line(preset_file, tmp_path, monkeypatch, failure, line):
    """The server's error (a full disk mid-run, a non-finite round) reaches `fedmvp train` as one line and
    exit 1, not Flower's logged traceback followed by "stopped after round N"."""
    import flwr.simulation

    import fedmvp.federated.server_app as server_app

    def failing_server(grid, settings):
        raise failure

    def fake_simulation(server_app, **kwargs):  # as Flower's engine: the ServerApp's error becomes its own
        try:
            server_app._main(None, None)
        except Exception as err:
            raise RuntimeError("An error was encountered. Ending simulation.") from err

    monkeypatch.setattr(server_app, "run_server", failing_server)
    monkeypatch.setattr(flwr.simulation, "run_simulation", fake_simulation)
    monkeypatch.setattr("fedmvp_apps.watchdog.start_watchdog", lambda: None)
    result = CliRunner().invoke(main, ["train", "--config", str(preset_file), "--run-dir", str(tmp_path / "r")])
    assert result.exit_code == 1, result.output
    assert line in result.output and len(result.output.strip().splitlines()) == 1


def test_deployment_resume_refuses_another_preset_and_accepts_the_original(preset_file, tmp_path):
    from fedmvp.federated.server_app import deployment_settings

    run = prepare_run(str(preset_file), str(tmp_path / "run"), None, False, "cpu", with_data=False)
    other = tmp_path / "other.toml"
    other.write_text(preset_file.read_text().replace("shots = 2", "shots = 1"))
    with pytest.raises(RuntimeError, match="was started with preset"):
        deployment_settings({"run-dir": str(run.path), "preset": str(other)})
    preset_file.write_text(preset_file.read_text().replace("shots = 2", "shots = 1"))  # edited: a warning later
    assert deployment_settings({"run-dir": str(run.path), "preset": str(preset_file)}).run_dir == str(run.path)


def test_the_run_records_its_whole_class_set(preset_file, tmp_path):
    """RUN/classes.json (fedmvp/run_classes.py): the federation's base then new classes in the set's order,
    each with its K phrases and sentence style, as the exporter bakes them in (docs/architecture.md)."""
    from fedmvp.data.federation import load_federation
    from fedmvp.run_classes import CLASSES_FILE
    from fedmvp.runs import RunError

    run = prepare_run(str(preset_file), str(tmp_path / "run"), None, False, "cpu")
    preset, federation = load_federation(str(preset_file))
    base, new = (next(e for e in federation.evaluations if e.kind == k) for k in ("base", "new"))
    recorded = run.class_set()
    assert [c.name for c in recorded] == base.class_names + new.class_names  # 4 base, then 2 new
    assert all(list(c.phrases) == base.attributes.get(c.name, new.attributes.get(c.name))[:preset.train.num_attributes]
               for c in recorded)
    assert {c.style for c in recorded} == {base.style}
    path = run.path / CLASSES_FILE
    record = json.loads(path.read_text())
    record["format_version"] = 99  # a newer fedmvp's record: refused, not misread
    path.write_text(json.dumps(record))
    with pytest.raises(RunError, match="classes.json: format_version 99"):
        run.class_set()
    path.unlink()
    assert run.class_set() is None  # a run of an older fedmvp: its readers migrate
    served = prepare_run(str(preset_file), str(tmp_path / "served"), None, False, "cpu", with_data=False)
    assert served.class_set() is None  # no phrases without the data: the exporter migrates
