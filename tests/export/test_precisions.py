"""fp16 and int8 bundles: smaller ONNX models, fp32 LoRA initializers, top-1 agreement >= 99%."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from export_helpers import NUM_CLASSES

from edge_client.bundle import read_bundle
from export.int8 import SCHEMES
from fedmvp_apps.export_cli import main


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_reduced_precision_bundle(precision, tiny_run, tiny_bundle, tmp_path):
    out = tmp_path / precision
    result = CliRunner().invoke(main, ["--run", str(tiny_run), "--precision", precision, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"parity {precision}:" in result.output
    bundle = read_bundle(out)
    parity = bundle.manifest["parity"]
    assert parity["fp32"]["passed"]  # fp32 is always checked on the way
    assert parity[precision]["images"] >= 32
    # fp16 meets the 99% with room to spare; int8 gets there by keeping the layers whose
    # quantisation flips predictions on the run's training images in fp32 (export/int8.py).
    assert parity[precision]["top1_agreement"] >= 0.99, parity[precision]
    assert parity[precision]["passed"]
    assert parity[precision]["max_abs_logit_diff"] < (0.05 if precision == "fp16" else 0.5)
    model = onnx.load(str(out / "model.onnx"))
    onnx.checker.check_model(model)
    inits = {i.name: i for i in model.graph.initializer}
    lora = bundle.manifest["onnx"]["lora_initializers"]
    assert all(inits[n].data_type == onnx.TensorProto.FLOAT for n in lora)  # swappable as fp32, un-quantized
    if precision == "int8":
        plan = bundle.manifest["onnx"]["int8"]  # held by accuracy on the run's 72 labelled test images
        assert plan["criterion"] == "accuracy" and plan["accuracy"]["images"] == 72
        assert plan["accuracy"]["drop_points"] <= plan["accuracy"]["max_drop_points"] == 1.0
        assert 0 < plan["calibration_agreement"] <= 1 and plan["calibration_images"] >= 32
        assert plan["scheme_choice"]["asked"] == "auto" and set(plan["scheme_choice"]["candidates"]) == set(SCHEMES)
        per_layer = {"dynamic": "MatMulInteger", "static": "DequantizeLinear"}[plan["scheme"]]  # static: + weights'
        assert sum(n.op_type == per_layer for n in model.graph.node) >= len(plan["quantized"]) > 0
        assert not set(plan["quantized"]) & set(plan["kept_fp32"])
        assert plan["sensitivity"] == "first-order" and plan["predicted_kept"] >= 0  # ranked in torch, not per layer
        assert f"int8: {len(plan['quantized'])} of" in result.output and "labelled held-out images" in result.output
    else:
        assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in inits.values())
    fp32_onnx_bytes = tiny_bundle.sizes["model.onnx"] + tiny_bundle.sizes["weights.safetensors"]
    assert (out / "model.onnx").stat().st_size < fp32_onnx_bytes
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"pixel_values": np.zeros((3, 3, 32, 32), np.float32)})[0]
    assert logits.shape == (3, NUM_CLASSES) and logits.dtype == np.float32


def test_the_accuracy_bound_reaches_the_plan_and_the_manifest_records_it(tiny_run, tmp_path):
    """--max-accuracy-drop travels to the int8 plan; the manifest (and --json) record fp32 and int8 accuracy
    on the run's labelled test images, the drop, the bound, agreement beside them, and the layer lists."""
    out = tmp_path / "int8"
    result = CliRunner().invoke(main, ["--run", str(tiny_run), "--precision", "int8", "--max-accuracy-drop",
                                       "0.25", "--out", str(out), "--inference-only", "--json"])
    assert result.exit_code == 0, result.output
    plan = read_bundle(out).manifest["onnx"]["int8"]
    assert plan == json.loads(result.stdout)["int8"]
    accuracy = plan["accuracy"]
    assert plan["criterion"] == "accuracy" and accuracy["max_drop_points"] == 0.25 and accuracy["images"] == 72
    assert accuracy["drop_points"] <= 0.25 and 0 < accuracy["fp32"] <= 1 and 0 < accuracy["int8"] <= 1
    assert accuracy["drop_points"] == pytest.approx(100 * (accuracy["fp32"] - accuracy["int8"]), abs=1e-3)
    assert 0 < accuracy["top1_agreement"] <= 1
    assert plan["quantized"] and not set(plan["quantized"]) & set(plan["kept_fp32"])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_tight_bound_keeps_more_layers_of_the_tiny_model_than_a_loose_one(tiny_run, tmp_path, scheme):
    """write_bundle on the real tiny model, judged on noise images labelled with fp32's own top-1 (fp32 100%
    accurate; their near-tied logits flip under int8): bound 0 keeps layers fp32, bound 100 keeps none,
    whichever the scheme."""
    from export_helpers import rebuilt_model

    from export import parity
    from export.bundle_writer import BundleInputs, BundleOptions, write_bundle
    from export.class_set import run_class_set, text_features
    from export.run_inputs import synthetic_images
    from fedmvp.runs import RunDir

    model, clip = rebuilt_model(tiny_run)
    classes = run_class_set(RunDir(tiny_run))
    images = synthetic_images(64, clip.image_size, seed=5)
    model.set_text_features(text_features(clip, classes))
    labels = parity.torch_logits(model, images).argmax(-1)
    kept = {}
    for bound in (0.0, 100.0):
        result = write_bundle(model, clip, classes, tmp_path / f"b{bound:g}",
                              BundleInputs(images, calibration=images[:32], labels=labels),
                              BundleOptions(precision="int8", training=False, max_accuracy_drop=bound,
                                            int8_scheme=scheme))
        accuracy = result.int8.accuracy
        assert result.int8.scheme == result.manifest["onnx"]["int8"]["scheme"] == scheme
        assert accuracy["fp32"] == 1.0 and accuracy["drop_points"] <= bound and accuracy["images"] == 64
        kept[bound] = len(result.int8.kept_fp32)
    assert kept[100.0] == 0 < kept[0.0], kept


def test_the_accuracy_bound_is_for_int8_only(tiny_run, tmp_path):
    result = CliRunner().invoke(main, ["--run", str(tiny_run), "--max-accuracy-drop", "1",
                                       "--out", str(tmp_path / "b")])
    assert result.exit_code == 2 and "--max-accuracy-drop applies to --precision int8, not fp32" in result.stderr


# What --int8-scheme leaves in model.onnx: ops that must be there, and the other scheme's that must not.
SCHEME_GRAPH = {"dynamic": ({"DynamicQuantizeLinear", "MatMulInteger"}, {"QuantizeLinear", "DequantizeLinear"}),
                "static": ({"QuantizeLinear", "DequantizeLinear"}, {"DynamicQuantizeLinear", "MatMulInteger"})}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_int8_scheme_reaches_the_graph_and_the_manifest(tiny_run, tmp_path, scheme):
    out = tmp_path / scheme
    result = CliRunner().invoke(main, ["--run", str(tiny_run), "--precision", "int8", "--int8-scheme", scheme,
                                       "--out", str(out), "--inference-only", "--json"])
    assert result.exit_code == 0, result.output
    manifest = read_bundle(out).manifest
    plan = manifest["onnx"]["int8"]
    assert plan["scheme"] == scheme and plan["scheme_choice"]["asked"] == scheme and plan["quantized"]
    assert (scheme == "static") == ("calibrated at export" in manifest["onnx"]["numerics"])
    kinds = {n.op_type for n in onnx.load(str(out / "model.onnx")).graph.node}
    present, absent = SCHEME_GRAPH[scheme]
    assert present <= kinds and not absent & kinds
    assert plan["accuracy"]["drop_points"] <= 1.0  # the bound held on the run's labelled test images


def test_the_int8_scheme_is_for_int8_only(tiny_run, tmp_path):
    result = CliRunner().invoke(main, ["--run", str(tiny_run), "--int8-scheme", "static", "--out", str(tmp_path / "b")])
    assert result.exit_code == 2 and "--int8-scheme applies to --precision int8, not fp32" in result.stderr
