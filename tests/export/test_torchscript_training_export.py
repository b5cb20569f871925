"""fedmvp-export --format torchscript on a trainable bundle also writes train.torchscript.pt: held to the eager
module (outputs and LoRA gradients), the same bytes from every export, none for an inference-only bundle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedmvp_apps.export_cli import main
from fedmvp_formats.files import sha256_file
from tests.deadlines import scaled

REPO = Path(__file__).resolve().parents[2]
MODULE = "train.torchscript.pt"


def test_a_training_parity_failure_refuses_the_export(tiny_run, tmp_path, monkeypatch):
    import export.torchscript_training as tst

    real = tst.export_training_module

    def doubled_lora(edge, *args, **kwargs):  # a module that computes another LoRA scaling than the eager one
        edge.lora_scaling, kept = edge.lora_scaling * 2.0, edge.lora_scaling
        try:
            real(edge, *args, **kwargs)
        finally:
            edge.lora_scaling = kept

    monkeypatch.setattr(tst, "export_training_module", doubled_lora)
    out = tmp_path / "bundle"
    result = CliRunner().invoke(main, ["--run", str(tiny_run), "--out", str(out), "--format", "torchscript",
                                       "--parity-images", "32"])
    assert result.exit_code == 1, result.output
    assert "torchscript training parity" in result.output and "FAILED" in result.output
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_an_inference_only_bundle_carries_no_training_module(tiny_run, tmp_path):
    out = tmp_path / "bundle"
    result = CliRunner().invoke(main, ["--run", str(tiny_run), "--out", str(out), "--format", "torchscript",
                                       "--inference-only", "--parity-images", "32", "--json"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert "torchscript" in manifest and "torchscript_training" not in manifest and not (out / MODULE).exists()


@pytest.mark.processes
def test_two_exports_write_the_same_training_module(tiny_run, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    hashes = []
    for name in ("a", "b"):
        done = subprocess.run([sys.executable, "-c", "from fedmvp_apps.export_cli import main; main()", "--run",
                               str(tiny_run), "--out", str(tmp_path / name), "--format", "torchscript",
                               "--parity-images", "32", "--json"], capture_output=True, text=True, timeout=scaled(600),
                              env=env, cwd=REPO)
        assert done.returncode == 0, done.stdout + done.stderr
        hashes.append(sha256_file(tmp_path / name / MODULE))
    assert hashes[0] == hashes[1]
