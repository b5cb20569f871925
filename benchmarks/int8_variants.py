"""int8 variants of a bundle's fp32 model with every weight MatMul quantised (no accuracy guard).

What the exporter's guarded int8 is compared with: the speed an all-int8 graph reaches here,
dynamic (weights s8 per channel, activations u8 per call) and static (calibrated QDQ)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnx


def folded_fp32(path: Path) -> tuple[onnx.ModelProto, list[str]]:
    """The bundle's fp32 graph with weight transposes folded (what a quantiser needs), and its LoRA names."""
    import onnx_ir as ir

    from export.int8 import matmuls_as_matmul
    from export.onnx_export import _folded

    proto = onnx.load(str(path))  # external data read in
    lora = [init.name for init in proto.graph.initializer if init.name.startswith("lora.")]
    return matmuls_as_matmul(_folded(ir.serde.deserialize_model(proto), lora)), lora


def write_variants(fp32: Path, calibration: np.ndarray, work: Path) -> dict[str, tuple[Path, float]]:
    """``{runtime: (model path, seconds to quantise)}`` for the all-layers dynamic and static int8 models."""
    from export.int8 import quantizable_layers, quantize

    proto, lora = folded_fp32(fp32)
    layers = quantizable_layers(proto, lora)
    out = {}
    start = time.perf_counter()
    dynamic = quantize(proto, layers)
    path = work / "int8_dynamic_all.onnx"
    path.write_bytes(dynamic.SerializeToString())
    out["ort_int8_dynamic_all"] = (path, time.perf_counter() - start)
    return out
