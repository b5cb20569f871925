"""The manifest's ``requires``: computed per role from one table, held to its shape, and checked on the device
before anything loads (a named runtime refused in one line, auto skipping it, info showing it, train refusing)."""

from __future__ import annotations

import json
from importlib.metadata import version

import pytest
from click.testing import CliRunner

from edge_client.bundle import BundleError, read_bundle
from edge_client.requirements import artifact_blockers, artifact_report
from edge_client.runtime_choice import choose
from fedmvp_apps.edge_cli import main
from fedmvp_formats.artifact_requirements import (REQUIRES, TRAIN_PT2_MIN_BY_EXPORTER, major_minor,
                                                  requirements_section, satisfies, version_key)
from fedmvp_formats.bundle_manifest import manifest_bytes

ROLES = {"onnx": "model.onnx", "lora": "lora.safetensors", "training": "train.pt2",
         "torchscript": "model.torchscript.pt", "torchscript_training": "train.torchscript.pt",
         "executorch": "model.pte", "weights": "weights.safetensors"}
EXPORTER = {"torch": "2.14.1+cpu", "executorch": "0.7.0"}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDMVP_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("role, opset, torch, expected", [
    ("onnx", 18, "2.14.1", {"onnxruntime": "1.14", "openvino": "2024.0"}),
    ("onnx", 17, "2.14.1", {"onnxruntime": "1.12", "openvino": "2024.0"}),
    ("onnx", 20, "2.14.1", {"onnxruntime": "1.17"}),  # no OpenVINO row for opset 20: not recorded for it
    ("training", 18, "2.14.1+cpu", {"torch": "2.9"}),  # measured: 2.14's archive loads from 2.9
    ("training", 18, "2.15.0", {"torch": "2.15"}),  # no measurement for that exporter: its own major.minor
    ("torchscript", 18, "2.14.1+cu130", {"torch": "2.4"}),  # measured
    ("torchscript", 18, "2.16.0", {"torch": "2.16"}),
    ("torchscript_training", 18, "2.14.1", {"torch": "2.4"}),
    ("executorch", 18, "2.14.1", {"executorch": "0.7"}),  # the exporter's executorch major.minor
    ("weights", 18, "2.14.1", None),  # no rule: nothing is recorded
    ("lora", 18, "2.14.1", None),
])
def test_each_role_gets_its_requirement_from_the_table(role, opset, torch, expected):
    manifest = {"files_by_role": {role: ROLES[role]}, "onnx": {"opset": opset}}
    section = requirements_section(manifest, {**EXPORTER, "torch": torch}.get)
    if expected is None:
        assert role not in section
        return
    assert section[role]["file"] == ROLES[role]
    assert {p: n["min"] for p, n in section[role]["needs"].items()} == expected
    assert all(n["why"] for n in section[role]["needs"].values())


def test_an_opset_without_an_onnx_runtime_row_is_refused_at_export():
    with pytest.raises(ValueError, match="ORT_BY_OPSET"):
        requirements_section({"files_by_role": {"onnx": "model.onnx"}, "onnx": {"opset": 99}}, EXPORTER.get)


@pytest.mark.parametrize("have, need, ok", [
    ("1.32.0", {"min": "1.14"}, True), ("1.14.0", {"min": "1.14"}, True), ("1.13.1", {"min": "1.14"}, False),
    ("2.14.1+cpu", {"min": "2.14"}, True), ("2.8.0", {"min": "2.14"}, False),
    ("2.6.0a0+ecf3bae40a.nv24.10", {"min": "2.6"}, True),  # a JetPack torch
    ("1.18.0rc1", {"min": "1.18"}, True), ("3.0", {"min": "2.8", "below": "3"}, False),
])
def test_versions_compare_by_release_numbers(have, need, ok):
    assert satisfies(have, need) is ok
    assert version_key("2.14.1+cu130") == (2, 14, 1)


def _edit(bundle_dir, change) -> None:
    """Change the manifest (its sha256 is the bundle's id: the edited bundle is another bundle, still whole)."""
    path = bundle_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_bytes(manifest_bytes(manifest))


def _need(role: str, package: str, **values):
    return lambda m: m[REQUIRES][role]["needs"][package].update(values)


def test_the_exported_bundle_records_and_runs_here(edge_bundle):
    bundle = read_bundle(edge_bundle)
    section = bundle.manifest[REQUIRES]
    assert set(section) == {"onnx", "training"}  # the files present that a rule covers
    assert section["onnx"]["needs"]["onnxruntime"]["why"] == f"opset {bundle.manifest['onnx']['opset']}"
    import onnx  # the requirement follows the opset model.onnx is stamped with

    stamped = onnx.load(str(bundle.file("onnx")), load_external_data=False).opset_import
    assert bundle.manifest["onnx"]["opset"] == next(o.version for o in stamped if o.domain in ("", "ai.onnx"))
    made = major_minor(version("torch"))
    assert section["training"]["needs"]["torch"]["min"] == TRAIN_PT2_MIN_BY_EXPORTER.get(made, made)
    assert artifact_blockers(bundle) == {}
    assert all(r["runs"] for r in artifact_report(bundle)["roles"].values())


@pytest.mark.parametrize("change, field", [
    (lambda m: m.update(requires=[1]), "requires"),
    (lambda m: m.update(requires={"nope": {"file": "x", "needs": {"torch": {"min": "2"}}}}), "requires.nope"),
    (lambda m: m[REQUIRES]["onnx"].update(file="weights.safetensors"), "requires.onnx.file"),
    (lambda m: m[REQUIRES]["onnx"].update(needs={}), "requires.onnx.needs"),
    (lambda m: m[REQUIRES]["onnx"].update(needs=["onnxruntime"]), "requires.onnx.needs"),
    (lambda m: m[REQUIRES]["onnx"]["needs"].update({"Bad Name": {"min": "1"}}), "requires.onnx.needs['Bad Name']"),
    (_need("onnx", "onnxruntime", min="1.x"), "requires.onnx.needs['onnxruntime'].min"),
    (_need("onnx", "onnxruntime", min="9" * 80), "requires.onnx.needs['onnxruntime'].min"),
    (_need("onnx", "onnxruntime", min=1.14), "requires.onnx.needs['onnxruntime'].min"),
    (_need("onnx", "onnxruntime", below=[2]), "requires.onnx.needs['onnxruntime'].below"),
    (_need("training", "torch", why="a\nb"), "requires.training.needs['torch'].why"),
    (_need("training", "torch", why="x" * 201), "requires.training.needs['torch'].why"),
])
def test_a_hostile_section_is_one_line_naming_the_field(bundle_dir, change, field):
    _edit(bundle_dir, change)
    with pytest.raises(BundleError) as err:
        read_bundle(bundle_dir)
    message = str(err.value)
    assert "manifest.json" in message and f"field {field}" in message and "\n" not in message


def test_a_runtime_named_that_this_device_cannot_run_is_refused_in_one_line(bundle_dir, data_root):
    _edit(bundle_dir, _need("onnx", "onnxruntime", min="99.0"))
    out = CliRunner().invoke(main, ["infer", str(data_root / "test" / "red_circle"), "--bundle", str(bundle_dir),
                                    "--runtime", "ort"])
    assert out.exit_code == 2, out.output
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: model.onnx needs onnxruntime >= 99.0 (opset 18); this device has "
                      f"{version('onnxruntime')}"]
    assert "classified" not in out.stderr  # refused before loading anything


def test_auto_skips_what_cannot_run_and_says_so(bundle_dir, data_root):
    pytest.importorskip("openvino")
    _edit(bundle_dir, _need("onnx", "openvino", min="9999.0"))
    choice = choose(read_bundle(bundle_dir), runtime="auto")
    assert choice.candidate.runtime == "ort"
    assert "openvino" in choice.skipped and "model.onnx needs openvino >= 9999.0" in choice.skipped["openvino"]
    assert "model.onnx needs openvino >= 9999.0" in choice.line and choice.to_json()["skipped"] == choice.skipped
    out = CliRunner().invoke(main, ["infer", str(data_root / "test" / "red_circle"), "--bundle", str(bundle_dir),
                                    "--runtime", "auto", "--json"])
    assert out.exit_code == 0, out.output
    assert "openvino >= 9999.0" in out.stderr and {json.loads(l)["runtime"] for l in out.stdout.splitlines()} == {"ort"}


def test_info_shows_what_runs_and_what_cannot(bundle_dir):
    _edit(bundle_dir, _need("training", "torch", min="99"))
    out = CliRunner().invoke(main, ["info", "--bundle", str(bundle_dir)])
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert any(line.startswith("requires:") for line in lines)
    onnx = next(line for line in lines if line.strip().startswith("model.onnx"))
    training = next(line for line in lines if line.strip().startswith("train.pt2"))
    assert " runs (onnx; onnxruntime >= 1.14 (opset 18): " in onnx
    assert "cannot run (training; torch >= 99" in training and version("torch") in training
    report = json.loads(CliRunner().invoke(main, ["info", "--bundle", str(bundle_dir), "--json"]).stdout)
    roles = report["requires"]["roles"]
    assert roles["onnx"]["runs"] is True and roles["training"]["runs"] is False
    assert roles["training"]["why"].startswith("train.pt2 needs torch >= 99")


def test_train_refuses_before_loading_a_program_this_torch_cannot_read(bundle_dir, data_root, tmp_path):
    _edit(bundle_dir, _need("training", "torch", min="99"))
    out = CliRunner().invoke(main, ["train", "--data", str(data_root / "train"), "--bundle", str(bundle_dir),
                                    "--out", str(tmp_path / "upd"), "--json"])
    assert out.exit_code == 2, out.output
    error = json.loads(out.stdout)["error"]
    assert error.startswith("cannot train on this device: train.pt2 needs torch >= 99 (torch.export archive")
    assert not (tmp_path / "upd").exists()


def test_a_bundle_exported_before_the_section_keeps_working(bundle_dir, data_root):
    _edit(bundle_dir, lambda m: m.pop(REQUIRES))
    bundle = read_bundle(bundle_dir)
    assert artifact_report(bundle) == {"recorded": False} and artifact_blockers(bundle) == {}
    out = CliRunner().invoke(main, ["info", "--bundle", str(bundle_dir)])
    assert out.exit_code == 0 and "requires:   not recorded" in out.stdout, out.output
    out = CliRunner().invoke(main, ["infer", str(data_root / "test" / "red_circle"), "--bundle", str(bundle_dir),
                                    "--runtime", "ort", "--json"])
    assert out.exit_code == 0, out.output


def test_auto_on_a_device_whose_onnx_runtime_is_too_old(bundle_dir):
    """ONNX Runtime is auto's reference: with it ruled out, one other candidate runs, several are refused."""
    pytest.importorskip("openvino")
    from edge_client.engines import candidates
    from edge_client.runtime import ProviderError

    _edit(bundle_dir, _need("onnx", "onnxruntime", min="99.0"))
    bundle = read_bundle(bundle_dir)
    found, notes = candidates(bundle, "auto", "auto")
    assert {c.runtime for c in found} == {"openvino"} and any("onnxruntime >= 99.0" in n for n in notes)
    if len(found) == 1:
        assert choose(bundle, runtime="auto").candidate.runtime == "openvino"
    else:
        with pytest.raises(ProviderError, match="auto verifies against ONNX Runtime, which cannot run"):
            choose(bundle, runtime="auto")
