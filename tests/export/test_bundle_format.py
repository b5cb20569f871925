"""edge_client.bundle: every file's sha256 is verified; tampering or a missing file is one line."""

from __future__ import annotations

import json
import shutil
import zipfile

import pytest

from edge_client.bundle import BundleError, read_bundle, verify_program_archive


@pytest.fixture
def bundle_copy(tiny_bundle, tmp_path):
    target = tmp_path / "bundle"
    shutil.copytree(tiny_bundle.path, target)
    return target


def _error(directory) -> str:
    with pytest.raises(BundleError) as info:
        read_bundle(directory)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_tampered_file(bundle_copy):
    data = bytearray((bundle_copy / "lora.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (bundle_copy / "lora.safetensors").write_bytes(bytes(data))
    assert "lora.safetensors" in _error(bundle_copy) and "sha256" in _error(bundle_copy)


def test_truncated_and_missing_files(bundle_copy):
    weights = bundle_copy / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert "weights.safetensors" in _error(bundle_copy)
    (bundle_copy / "train.pt2").unlink()
    assert "train.pt2: missing" in _error(bundle_copy)


def test_manifest_problems(bundle_copy, tmp_path):
    manifest = bundle_copy / "manifest.json"
    data = json.loads(manifest.read_text())
    data["format_version"] = 99
    manifest.write_text(json.dumps(data))
    assert "format version 99" in _error(bundle_copy)
    data["format_version"] = 2
    without_method = {k: v for k, v in data.items() if k != "method"}  # what an older exporter wrote
    manifest.write_text(json.dumps(without_method))
    message = _error(bundle_copy)
    assert "manifest.json" in message and "method" in message and "re-export" in message
    manifest.write_text(json.dumps({**data, "method": {k: v for k, v in data["method"].items() if k != "alpha"}}))
    assert "field method: method record does not match this fedmvp (missing alpha)" in _error(bundle_copy)
    without_lora = {k: v for k, v in data.items() if k != "lora"}
    manifest.write_text(json.dumps(without_lora))
    assert "manifest.json: field lora: missing" in _error(bundle_copy)
    manifest.write_text(json.dumps({**data, "classes": ["cat"]}))
    assert "manifest.json: field classes: must be a mapping, got list" in _error(bundle_copy)
    manifest.write_text("{not json")
    assert "corrupt JSON" in _error(bundle_copy)
    manifest.unlink()
    assert "missing" in _error(bundle_copy)
    assert "not a bundle directory" in _error(tmp_path / "nowhere")


def test_program_archive_with_pickled_payload_is_refused(bundle_copy):
    source = bundle_copy / "train.pt2"
    verify_program_archive(source)
    evil = bundle_copy / "evil.pt2"
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(evil, "w") as dst:
        for info in src.infolist():
            payload = b"cos\nsystem\n(S'echo hi'\ntR." if info.filename.endswith("sample_inputs/model.pt") \
                else src.read(info)
            dst.writestr(info.filename, payload)
    with pytest.raises(BundleError, match="must be empty"):
        verify_program_archive(evil)


def test_the_model_declares_the_lowest_ir_version_its_opsets_need(tiny_bundle):
    """An ONNX Runtime a release behind the onnx package refuses the newest IR version ("Unsupported
    model IR version: 14, max supported IR version: 13", seen on a GPU machine): the exporter writes the
    lowest one the opsets need, and never raises it."""
    import onnx
    from onnx import helper

    from export.onnx_export import portable_ir_version

    model = onnx.load(str(tiny_bundle.path / "model.onnx"), load_external_data=False)
    assert model.ir_version == portable_ir_version(model) <= 10
    newest = helper.make_model(helper.make_graph([], "g", [], []),
                               opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    newest.ir_version = 14
    assert portable_ir_version(newest) == 8
    older = helper.make_model(helper.make_graph([], "g", [], []), opset_imports=[helper.make_opsetid("", 18)])
    older.ir_version = 7
    assert portable_ir_version(older) == 7
