"""`fedmvp info` and the CLI surface."""

from __future__ import annotations

import json
import subprocess
import sys

from click.testing import CliRunner

from fedmvp_apps.cli import main
import pytest


def test_info_json_reports_counts_and_upload_bytes():
    result = CliRunner().invoke(main, ["info", "--model", "fedmvp-tiny", "--classes", "7", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["promptformer_params"] == 281_088 and data["lora_params"] == 6_144
    assert data["promptformer_to_lora"] == round(281_088 / 6_144, 2)
    # fp32 tensors plus a small safetensors header
    assert 4 * 281_088 < data["upload_bytes_full"] < 4 * 281_088 + 4096
    assert 4 * 6_144 < data["upload_bytes_lora"] < 4 * 6_144 + 2048
    assert data["attribute_sentences"] == 70


def test_info_unknown_model_is_one_line_and_exit_2():
    result = CliRunner().invoke(main, ["info", "--model", "ViT-Q-1"])
    assert result.exit_code == 2
    assert result.output.strip().count("\n") == 0 and "unknown CLIP model 'ViT-Q-1'" in result.output


@pytest.mark.processes
def test_console_scripts_have_help():
    for module in ("fedmvp_apps.cli", "fedmvp_apps.export_cli", "fedmvp_apps.edge_cli"):
        out = subprocess.run([sys.executable, "-c", f"from {module} import main; main()", "--help"],
                             capture_output=True, text=True, check=True).stdout
        assert "Usage:" in out and len(out.splitlines()) > 5
