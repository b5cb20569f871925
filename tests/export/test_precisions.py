"""fp16 and int8 bundles: smaller ONNX models, fp32 LoRA initializers, top-1 agreement >= 99%."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from export_helpers import NUM_CLASSES

from edge_client.bundle import read_bundle
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
    kinds = {n.op_type for n in model.graph.node}
    if precision == "int8":
        plan = bundle.manifest["onnx"]["int8"]
        assert plan["calibration_agreement"] >= 0.99 and plan["calibration_images"] >= 32
        assert sum(n.op_type == "MatMulInteger" for n in model.graph.node) == len(plan["quantized"]) > 0
        assert not set(plan["quantized"]) & set(plan["kept_fp32"])
        assert plan["sensitivity"] == "first-order" and plan["predicted_kept"] >= 0  # ranked in torch, not per layer
        assert f"int8: {len(plan['quantized'])} of" in result.output
    else:
        assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in inits.values())
    fp32_onnx_bytes = tiny_bundle.sizes["model.onnx"] + tiny_bundle.sizes["weights.safetensors"]
    assert (out / "model.onnx").stat().st_size < fp32_onnx_bytes
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"pixel_values": np.zeros((3, 3, 32, 32), np.float32)})[0]
    assert logits.shape == (3, NUM_CLASSES) and logits.dtype == np.float32
