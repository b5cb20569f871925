"""int8 variants of a bundle's fp32 model with every weight MatMul quantised (no accuracy guard).

What the exporter's guarded int8 is compared with: the speed an all-int8 graph reaches here,
dynamic (weights s8 per channel, activations u8 per call) and static (calibrated QDQ), built by
the exporter's own quantisation functions (export/int8.py)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnx


def write_variants(fp32: Path, calibration: np.ndarray, work: Path) -> dict[str, tuple[Path, float]]:
    """``{runtime: (model path, seconds to quantise)}`` for the all-layers dynamic and static int8 models."""
    from export.int8 import quantize_dynamic_model, quantize_static_model
    from export.onnx_export import prepare_fp32

    proto = onnx.load(str(fp32))  # external data read in
    lora = [init.name for init in proto.graph.initializer if init.name.startswith("lora.")]
    proto = prepare_fp32(proto, lora)
    builders = {"ort_int8_dynamic_all": lambda: quantize_dynamic_model(proto, None, lora),
                "ort_int8_static_all": lambda: quantize_static_model(proto, calibration, None, lora)}
    out = {}
    for key, build in builders.items():
        start = time.perf_counter()
        model = build()
        path = work / f"{key}.onnx"
        path.write_bytes(model.SerializeToString())
        out[key] = (path, time.perf_counter() - start)
    return out
