"""fedmvp-export refuses bad input with one line and exit code 2, before any heavy work."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from fedmvp_apps.export_cli import main


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


def _one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def test_missing_round_lists_rounds(tiny_run, tmp_path):
    line = _one_line_error(_run("--run", str(tiny_run), "--round", "50", "--out", str(tmp_path / "b")))
    assert "round 50 not found" in line and "1, 2" in line and str(tiny_run) in line


def test_corrupt_checkpoint(run_copy, tmp_path):
    (run_copy / "round-0002" / "global.safetensors").write_bytes(b"\x00garbage" * 10)
    line = _one_line_error(_run("--run", str(run_copy), "--round", "2", "--out", str(tmp_path / "b")))
    assert "corrupt checkpoint" in line and "round-0002" in line


def test_checkpoint_of_another_model(run_copy, tmp_path):
    from safetensors.torch import save_file
    import torch

    save_file({"promptformer.text_proj.weight": torch.zeros(3, 3)}, str(run_copy / "round-0002" / "global.safetensors"))
    line = _one_line_error(_run("--run", str(run_copy), "--round", "2", "--out", str(tmp_path / "b")))
    assert "global.safetensors" in line and "does not fit" in line


def test_existing_out_without_force(tiny_run, tmp_path):
    out = tmp_path / "bundle"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    line = _one_line_error(_run("--run", str(tiny_run), "--out", str(out)))
    assert str(out) in line and "--force" in line
    assert (out / "keep.txt").read_text() == "mine"


def test_not_a_run_and_no_runs(tmp_path, monkeypatch):
    line = _one_line_error(_run("--run", str(tmp_path)))
    assert "not a fedmvp run" in line
    monkeypatch.chdir(tmp_path)
    line = _one_line_error(_run())
    assert "no run found" in line


def test_bad_attributes_file(tiny_run, tmp_path):
    bad = tmp_path / "attrs.json"
    bad.write_text("[1, 2]")
    line = _one_line_error(_run("--run", str(tiny_run), "--attributes", str(bad), "--out", str(tmp_path / "b")))
    assert str(bad) in line


def test_json_error_output(tiny_run, tmp_path):
    result = _run("--run", str(tiny_run), "--round", "9", "--json", "--out", str(tmp_path / "b"))
    assert result.exit_code == 2
    report = json.loads(result.output.strip().splitlines()[-1])
    assert report["ok"] is False and "round 9 not found" in report["error"]


@pytest.mark.parametrize("precision", ["fp64"])
def test_unknown_precision_is_a_usage_error(tiny_run, precision):
    assert _run("--run", str(tiny_run), "--precision", precision).exit_code == 2


def test_fp32_parity_failure_exits_1_and_writes_nothing(tiny_run, tmp_path, monkeypatch):
    import fedmvp_formats.parity_rules

    monkeypatch.setattr(fedmvp_formats.parity_rules, "FP32_MAX_ABS_DIFF", -1.0)  # no export can meet this
    out = tmp_path / "bundle"
    result = _run("--run", str(tiny_run), "--out", str(out), "--parity-images", "32")
    assert result.exit_code == 1, result.output
    assert "parity failed, no bundle written" in result.output and "parity fp32" in result.output
    assert not out.exists() and list(tmp_path.iterdir()) == []  # the temp directory is gone too


def _device_made(out):
    """A bundle directory as a device leaves it: personalised LoRAs and the bundle before a refresh."""
    (out / "personalised").mkdir(parents=True)
    (out / "personalised" / "state.json").write_text('{"active": "lora-0001.safetensors"}')
    (out / "previous").mkdir()
    (out / "previous" / "lora.safetensors").write_bytes(b"old bundle")


def test_force_refuses_to_delete_device_state(tiny_bundle, tmp_path):
    import shutil

    out = tmp_path / "bundle"
    shutil.copytree(tiny_bundle.path, out)
    _device_made(out)
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    line = _one_line_error(_run("--run", tiny_bundle.manifest["source"]["run_path"], "--out", str(out), "--force"))
    assert "personalised/" in line and "previous/" in line and "--discard-device-state" in line
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before


def test_discard_device_state_replaces_and_says_what_went(tiny_bundle, tmp_path):
    import shutil

    out = tmp_path / "bundle"
    shutil.copytree(tiny_bundle.path, out)
    _device_made(out)
    result = _run("--run", tiny_bundle.manifest["source"]["run_path"], "--out", str(out), "--force",
                  "--discard-device-state", "--parity-images", "32")
    assert result.exit_code == 0, result.output
    assert "discarded device state of the replaced bundle: personalised/, previous/" in result.output
    assert not (out / "personalised").exists() and not (out / "previous").exists()


def test_nan_checkpoint_is_named_not_a_parity_verdict(run_copy, tmp_path):
    from safetensors.torch import load_file, save_file

    path = run_copy / "round-0002" / "global.safetensors"
    tensors = load_file(str(path))
    name = sorted(n for n in tensors if n.startswith("promptformer."))[0]
    tensors[name][..., 0] = float("nan")
    save_file(tensors, str(path))
    out = tmp_path / "b"
    line = _one_line_error(_run("--run", str(run_copy), "--round", "2", "--out", str(out)))
    assert "round-0002/global.safetensors" in line and name in line and "NaN" in line
    assert not out.exists()


def test_attributes_with_unequal_phrase_counts_name_the_class(tiny_run, tmp_path):
    attrs = tmp_path / "attrs.json"
    attrs.write_text(json.dumps({"giraffe": [f"long neck {i}" for i in range(10)], "zebra": ["stripes"],
                                 "okapi": [f"striped legs {i}" for i in range(10)]}))
    line = _one_line_error(_run("--run", str(tiny_run), "--attributes", str(attrs), "--out", str(tmp_path / "b")))
    assert str(attrs) in line and "'zebra' has 1" in line and "most have 10" in line
    assert not (tmp_path / "b").exists()
