"""The int8 accuracy guard on hand-built ONNX models: what it quantises, what it keeps, when it stops."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from export.int8 import (AccuracyTarget, Int8Error, expected_agreement, matmuls_as_matmul, plan_int8,
                         quantizable_layers, quantize)

WIDTH, CLASSES, IMAGES = 32, 64, 256


def mlp(seed: int, margin: float) -> onnx.ModelProto:
    """x [N, WIDTH] -> 3 MatMuls (one a Gemm) -> logits; a class bias of spread ``margin`` sets how far
    apart the top logits lie (int8 error is relative to the weights, the bias is not quantised)."""
    rng = np.random.default_rng(seed)
    weights = [rng.normal(0, 1 / np.sqrt(WIDTH), (WIDTH, WIDTH)).astype(np.float32) for _ in range(2)]
    head = rng.normal(0, 1, (CLASSES, WIDTH)).astype(np.float32)
    bias = (margin * rng.normal(0, 1, CLASSES)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["h0"], name="layer0"),
             helper.make_node("Relu", ["h0"], ["r0"], name="relu"),
             helper.make_node("MatMul", ["r0", "w1"], ["h1"], name="layer1"),
             helper.make_node("Gemm", ["h1", "head", "bias"], ["logits"], name="head", transB=1)]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", WIDTH])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", CLASSES])],
        [numpy_helper.from_array(weights[0], "w0"), numpy_helper.from_array(weights[1], "w1"),
         numpy_helper.from_array(head, "head"), numpy_helper.from_array(bias, "bias")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "m.onnx"
        path.write_bytes(model.SerializeToString())
        return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def runner(x: np.ndarray):
    """plan_int8's ``run``: a model's logits on the first ``limit`` rows of ``x``."""
    return lambda model, limit: run(model, x[:limit])


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    return np.random.default_rng(7).normal(0, 1, (IMAGES, WIDTH)).astype(np.float32)


def test_gemm_becomes_a_named_matmul_and_every_constant_weight_counts():
    proto = matmuls_as_matmul(mlp(0, 1.0))
    assert [n.op_type for n in proto.graph.node if n.name.startswith("head")][0] == "MatMul"
    layers = quantizable_layers(proto, [])
    assert len(layers) == 3 and layers[:2] == ["layer0", "layer1"]
    assert quantizable_layers(proto, ["w1"]) == [layers[0], layers[2]]  # a protected input stays fp32


@pytest.mark.parametrize(("margin", "target", "expect"), [
    (100.0, 0.99, "all quantised"),  # far-apart logits: int8 flips nothing, one quantisation suffices
    (0.0, 1.0, "some kept"),         # many near-ties: only keeping layers in fp32 reaches 100%
])
def test_plan_reaches_the_target_on_calibration_images(images, margin, target, expect):
    proto = matmuls_as_matmul(mlp(1, margin))
    reference = run(proto, images)
    model, plan = plan_int8(proto, [], reference, runner(images), target)
    out = run(model, images)
    agreement = float(np.mean(out.argmax(-1) == reference.argmax(-1)))
    assert agreement == pytest.approx(plan.calibration_agreement) and agreement >= target
    assert plan.calibration_expected_agreement == pytest.approx(expected_agreement(reference, out))
    assert plan.calibration_expected_agreement >= target
    assert sorted(plan.quantized + plan.kept_fp32) == sorted(quantizable_layers(proto, []))
    assert sum(n.op_type == "MatMulInteger" for n in model.graph.node) == len(plan.quantized)
    if expect == "all quantised":
        assert plan.kept_fp32 == [] and plan.searched == 1
    else:
        full = run(quantize(proto, quantizable_layers(proto, [])), images)
        assert np.mean(full.argmax(-1) == reference.argmax(-1)) < target  # the guard had work to do
        assert plan.kept_fp32 and plan.searched > 1


def test_a_wrong_prediction_is_caught_by_the_verifying_run_and_searched_past(images):
    proto = matmuls_as_matmul(mlp(1, 0.0))
    reference = run(proto, images)
    layers = quantizable_layers(proto, [])
    blind = {name: np.zeros(IMAGES) for name in layers}  # "nothing moves": predicts keeping none
    model, plan = plan_int8(proto, [], reference, runner(images), 1.0, shifts=blind)
    out = run(model, images)
    assert plan.sensitivity == "first-order" and plan.predicted_kept == 0
    assert plan.kept_fp32 and plan.searched > 1  # the real run refused the prediction
    assert np.mean(out.argmax(-1) == reference.argmax(-1)) == 1.0 and plan.calibration_expected_agreement == 1.0


def test_a_model_without_constant_matmuls_is_refused(images):
    proto = matmuls_as_matmul(mlp(2, 1.0))
    names = [i.name for i in proto.graph.initializer]
    with pytest.raises(Int8Error, match="no MatMul"):
        plan_int8(proto, names, run(proto, images), runner(images), 0.99)


# Two images with top-1 margins 1.0 and 3.0; the shift is what quantisation does to each margin.
@pytest.mark.parametrize(("shifts", "expected"), [
    ((0.0, 0.0), 1.0),    # nothing moves: every image keeps its top-1
    ((2.0, 2.0), 0.5),    # a shift of 2 flips the image whose margin is 1, not the one of 3
    ((0.5, 4.0), 0.5),    # shift 0.5 < both margins, shift 4 > both: half of the four pairs flip
    ((5.0, 5.0), 0.0),    # larger than every margin
])
def test_expected_agreement_pairs_every_shift_with_every_margin(shifts, expected):
    reference = np.array([[1.0, 0.0, -5.0], [3.0, 0.0, -5.0]])
    logits = reference.copy()
    logits[:, 0] -= np.array(shifts)  # the top-1 logit drops by the shift: the margin shrinks by it
    assert expected_agreement(reference, logits) == pytest.approx(expected)



def labelled(x: np.ndarray, reference: np.ndarray, seed: int = 3) -> AccuracyTarget:
    """Labels: fp32's top-1, a quarter of them replaced by another class (fp32 is ~75% accurate)."""
    rng = np.random.default_rng(seed)
    labels = reference.argmax(-1)
    wrong = rng.random(len(labels)) < 0.25
    labels[wrong] = (labels[wrong] + 1 + rng.integers(0, CLASSES - 1, int(wrong.sum()))) % CLASSES
    return AccuracyTarget(reference, labels, 0.0, lambda model: run(model, x))


@pytest.mark.parametrize(("ranking", "scheme"), [("per-layer", "dynamic"), ("first-order", "dynamic"),
                                                ("per-layer", "static"), ("first-order", "static")])
def test_a_tight_accuracy_bound_keeps_more_layers_than_a_loose_one(images, ranking, scheme):
    """The task accuracy on labelled images decides (not agreement): a loose bound quantises every layer,
    a tight one keeps layers fp32, the fewest along the ranking (one fewer breaks the bound); for either
    scheme, static's ranges calibrated on the calibration images (here the same images)."""
    proto = matmuls_as_matmul(mlp(1, 0.0))
    layers = quantizable_layers(proto, [])
    reference = run(proto, images)
    target = labelled(images, reference)
    scheme_quantize = lambda names: quantize(proto, names, scheme, images)  # noqa: E731
    full = run(scheme_quantize(layers), images)
    assert target.drop_points(full) > 0  # all int8 loses accuracy here: the tight bound has work to do
    # first-order: estimates saying every layer matters, so the search starts at keeping all and goes down
    shifts = {name: np.full(IMAGES, 1e3) for name in layers} if ranking == "first-order" else None
    plans = {}
    for bound in (0.0, 100.0):
        target.max_drop_points = bound
        model, plan = plan_int8(proto, [], reference, runner(images), 0.99, shifts=shifts, accuracy=target,
                                scheme=scheme, calibration=images)
        out = run(model, images)
        assert plan.criterion == "accuracy" and plan.accuracy["max_drop_points"] == bound
        assert plan.scheme == scheme and ops(model).get(SCHEME_OPS[scheme][1], 0) == len(plan.quantized)
        assert plan.accuracy["fp32"] == pytest.approx(target.fp32) and 0.6 < target.fp32 < 0.9
        assert plan.accuracy["drop_points"] == pytest.approx(target.drop_points(out), abs=1e-3)
        assert target.drop_points(out) <= bound
        assert plan.accuracy["int8"] == pytest.approx(target.fp32 - target.drop_points(out) / 100)
        assert plan.accuracy["top1_agreement"] == pytest.approx(np.mean(out.argmax(-1) == reference.argmax(-1)))
        assert plan.calibration_agreement == pytest.approx(plan.accuracy["top1_agreement"])  # same images here
        plans[bound] = plan
    assert plans[100.0].kept_fp32 == [] and len(plans[0.0].kept_fp32) > 0
    tight = plans[0.0].kept_fp32  # the ranking's first ones
    fewer = run(scheme_quantize([name for name in layers if name not in tight[:-1]]), images)
    assert target.drop_points(fewer) > 0.0  # one layer fewer kept breaks the tight bound


# What each scheme leaves in the graph: (its activation quantiser, the op counted once per quantised layer).
SCHEME_OPS = {"dynamic": ("DynamicQuantizeLinear", "MatMulInteger"), "static": ("QuantizeLinear", "DequantizeLinear")}


def ops(model: onnx.ModelProto) -> dict[str, int]:
    """Op type -> count; for static only the DequantizeLinear nodes of constant weights (one per layer)."""
    weights = {init.name for init in model.graph.initializer}
    out: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] not in weights:
            continue  # an activation's
        out[node.op_type] = out.get(node.op_type, 0) + 1
    return out


@pytest.mark.parametrize(("scheme", "absent"), [("dynamic", "QuantizeLinear"), ("static", "MatMulInteger")])
def test_the_scheme_decides_the_graph_and_the_kept_layers_get_no_int8_ops(images, scheme, absent):
    """quantize(scheme): dynamic -> DynamicQuantizeLinear + MatMulInteger, static -> QuantizeLinear on the
    activation and a DequantizeLinear'd s8 weight per layer; the layer left out stays a plain fp32 MatMul."""
    proto = matmuls_as_matmul(mlp(1, 1.0))
    layers = quantizable_layers(proto, [])
    model = quantize(proto, layers[1:], scheme, images)
    found = ops(model)
    quantiser, per_layer = SCHEME_OPS[scheme]
    assert found.get(quantiser, 0) >= 1 and found[per_layer] == 2 and absent not in found
    kept = next(n for n in model.graph.node if n.name == layers[0])
    assert kept.op_type == "MatMul" and list(kept.input) == ["x", "w0"]  # fp32 input, fp32 weight
    reference = run(proto, images)
    assert np.mean(run(model, images).argmax(-1) == reference.argmax(-1)) > 0.9  # int8, not garbage


def test_static_needs_calibration_images_and_an_unknown_scheme_is_refused(images):
    proto = matmuls_as_matmul(mlp(1, 1.0))
    layers = quantizable_layers(proto, [])
    with pytest.raises(Int8Error, match="calibration images"):
        quantize(proto, layers, "static")
    with pytest.raises(Int8Error, match="blockwise"):
        plan_int8(proto, [], run(proto, images), runner(images), 0.99, scheme="blockwise")
