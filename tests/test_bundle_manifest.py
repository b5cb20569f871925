"""fedmvp_formats.bundle_manifest, the one manifest schema the exporter writes by and the device reads by."""

from __future__ import annotations

import copy

import pytest

from fedmvp_formats.bundle_manifest import (FORMAT, FORMAT_VERSION, PRECISIONS, ROLES, SECTIONS, ManifestError,
                                            check_manifest)
from fedmvp_formats.method import MethodRecord

WHERE = "bundle/manifest.json"
SHA = "0" * 64


def manifest() -> dict:
    """A manifest with every section (as fedmvp-export writes them, minus what only the reader's files check)."""
    files = {name: {"sha256": SHA, "bytes": 10} for name in ROLES.values()}
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "files": files,
            "method": MethodRecord().to_dict(), "classes": {"names": ["cat", "dog"], "count": 2},
            "preprocess": {}, "precision": "fp32", "files_by_role": dict(ROLES),
            "lora": {"tensors": {"lora.block.attn.to_q.lora_A.weight": [4, 8]}},
            "source": {"round": 2, "run_id": "run-1"}, "model": {}, "onnx": {"num_classes": 2},
            "training": {}, "parity": {}, "promptformer": {},
            "check_images": {"file": ROLES["check"], "source": "run-test", "images": 32, "generated": 0}}


def _error(m) -> str:
    with pytest.raises(ManifestError) as info:
        check_manifest(m, WHERE)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"{WHERE}: ")
    return text


def test_a_whole_manifest_passes_and_gives_its_method_record():
    assert check_manifest(manifest(), WHERE) == MethodRecord()
    required_only = {k: v for k, v in manifest().items() if SECTIONS[k][1]}  # optional sections may be absent
    del required_only["files_by_role"]["check"]  # with the check images' section, their role (a bundle before them)
    assert check_manifest(required_only, WHERE) == MethodRecord()
    assert check_manifest({**manifest(), "training": None}, WHERE) == MethodRecord()  # an inference-only bundle


REQUIRED = sorted(k for k, (_, required) in SECTIONS.items() if required and k not in ("format", "format_version"))


@pytest.mark.parametrize("key", REQUIRED)
def test_a_missing_required_key_is_one_line(key):
    m = manifest()
    del m[key]
    assert f"field {key}: missing" in _error(m)


WRONG_TYPES = [(k, [1]) for k in SECTIONS if k not in ("format", "format_version", "training")] + [
    ("training", "torch.export"), ("precision", 16), ("format_version", True)]


@pytest.mark.parametrize("key, value", WRONG_TYPES, ids=[f"{k}={v!r}" for k, v in WRONG_TYPES])
def test_a_wrong_type_is_one_line_naming_the_field(key, value):
    message = _error({**manifest(), key: value})
    assert f"field {key}: must be" in message or (key == "format_version" and "format version True" in message) \
        or (key == "format" and f"not a {FORMAT} manifest" in message)


BAD = [  # (what, edit, what the line says)
    ("another format", lambda m: m.update(format="zip"), f"not a {FORMAT} manifest"),
    ("newer version", lambda m: m.update(format_version=FORMAT_VERSION + 1), "re-export the bundle or update"),
    ("no files", lambda m: m.update(files={}), "field files: lists no files"),
    ("file entry", lambda m: m["files"].update({"model.onnx": {"sha256": "x", "bytes": 1}}),
     "field files['model.onnx']: must be"),
    ("file size", lambda m: m["files"]["model.onnx"].update(bytes=-1), "field files['model.onnx']"),
    ("method value", lambda m: m["method"].update(lora_rank=0),
     "field method: method record: lora_rank must be at least 1, got 0; re-export"),
    ("method field", lambda m: m["method"].pop("alpha"), "field method: method record does not match this fedmvp "
                                                         "(missing alpha); re-export"),
    ("method version", lambda m: m["method"].update(version=99), "field method: method record version 99 is newer"),
    ("precision", lambda m: m.update(precision="int4"),
     f"field precision: 'int4' is not one of {', '.join(PRECISIONS)}"),
    ("class twice", lambda m: m["classes"].update(names=["cat", "cat"]), "field classes.names: names a class twice"),
    ("class count", lambda m: m["classes"].update(count=3), "field classes.count: 3, but classes.names lists 2"),
    ("model outputs", lambda m: m["onnx"].update(num_classes=5), "field onnx.num_classes"),
    ("role unlisted", lambda m: m["files_by_role"].update(onnx="other.onnx"), "field files_by_role"),
    ("no lora role", lambda m: m["files_by_role"].pop("lora"), "field files_by_role"),
    ("lora shape", lambda m: m["lora"].update(tensors={"lora.x": [4, 0]}), "field lora.tensors"),
    ("source round", lambda m: m["source"].update(round="2"), "field source.round"),
    ("source run", lambda m: m["source"].update(run_id=7), "field source.run_id"),
    ("check role alone", lambda m: m.pop("check_images"), "field check_images: missing, but files_by_role names"),
    ("check file", lambda m: m["check_images"].update(file="model.onnx"), "field check_images.file"),
    ("check source", lambda m: m["check_images"].update(source="elsewhere"), "field check_images.source"),
    ("check count", lambda m: m["check_images"].update(images=0), "field check_images.images"),
    ("check generated", lambda m: m["check_images"].update(generated=33), "field check_images.generated"),
]


@pytest.mark.parametrize("what, edit, says", BAD, ids=[b[0] for b in BAD])
def test_each_broken_section_is_one_line(what, edit, says):
    m = copy.deepcopy(manifest())
    edit(m)
    assert says in _error(m)


def test_a_version_less_method_record_of_an_existing_bundle_is_read():
    m = manifest()
    m["method"].pop("version")
    assert check_manifest(m, WHERE) == MethodRecord()


def test_an_int8_plan_names_its_layers_and_its_criterion_measures_numbers():
    """onnx.int8: the accuracy criterion records the accuracies, the drop and the bound (export/int8.py)."""
    accuracy = {"images": 72, "fp32": 0.8, "int8": 0.79, "drop_points": 1.0, "max_drop_points": 1.0,
                "top1_agreement": 0.97}
    plan = {"quantized": ["a"], "kept_fp32": ["b"], "criterion": "accuracy", "accuracy": accuracy}
    m = manifest()
    for ok in (plan, {"quantized": [], "kept_fp32": ["b"]}, {**plan, "criterion": "agreement", "accuracy": None},
               {**plan, "scheme": "static"}, {**plan, "scheme": "dynamic"}):  # no scheme: an older bundle, dynamic
        m["onnx"]["int8"] = ok
        assert check_manifest(m, WHERE) == MethodRecord()
    for bad, field in (({**plan, "kept_fp32": "b"}, "onnx.int8.kept_fp32"),
                       ({**plan, "criterion": "luck"}, "onnx.int8.criterion"),
                       ({**plan, "scheme": "blockwise"}, "onnx.int8.scheme"),
                       ({**plan, "accuracy": {**accuracy, "drop_points": None}}, "onnx.int8.accuracy"),
                       ({**plan, "accuracy": None}, "onnx.int8.accuracy")):
        m["onnx"]["int8"] = bad
        assert f"field {field}:" in _error(m)
