"""A run's settings are its record: config.json keeps the preset's text, and a resume uses that."""

from __future__ import annotations

import hashlib
import json
import os

from click.testing import CliRunner

from fedmvp.cli import main
from fedmvp.federated.prepare import prepare_run, run_preset
from fedmvp.presets.schema import load_preset
from fedmvp.runs import RunDir


def test_resume_uses_the_recorded_preset_and_says_the_file_changed(preset_file, tmp_path, capsys):
    run = prepare_run(str(preset_file), str(tmp_path / "run"), None, False, "cpu")
    config = run.read_config()
    original = preset_file.read_text()
    assert config["preset_text"] == original
    assert config["preset_sha256"] == hashlib.sha256(original.encode()).hexdigest()
    assert run_preset(run) == str(preset_file.resolve())  # unchanged: the original path (deployed clients)
    preset_file.write_text(original.replace("shots = 2", "shots = 1").replace("sigma = 1000.0", "sigma = 0.0"))
    capsys.readouterr()
    resumed = prepare_run(str(preset_file), str(run.path), None, True, "cpu")
    used = run_preset(resumed)
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
    assert run_preset(run) == config["preset_path"]
    assert "no recorded preset text" in capsys.readouterr().err
    json.loads(run.config_path.read_text())
