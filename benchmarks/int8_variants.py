"""int8 variants of a bundle's fp32 model with every weight MatMul quantised (no accuracy bound).

What the exporter's accuracy-bounded int8 is compared with: the speed an all-int8 graph reaches here,
dynamic (weights s8 per channel, activations u8 per call) and static (calibrated QDQ), built by
the exporter's own quantisation functions (export/int8.py), and blockwise (ONNX Runtime's
``MatMulNBits``, 8-bit weights in blocks of 128, int8 compute): which of them holds accuracy at the
higher speed is measured here, not assumed (docs/architecture.md, "int8")."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnx


def write_variants(fp32: Path, calibration: np.ndarray, work: Path) -> dict[str, tuple[Path, float]]:
    """``{runtime: (model path, seconds to quantise)}`` for the all-layers dynamic and static int8 models."""
    from export.int8_quantize import quantize_dynamic_model, quantize_static_model
    from export.onnx_export import prepare_fp32

    proto = onnx.load(str(fp32))  # external data read in
    lora = [init.name for init in proto.graph.initializer if init.name.startswith("lora.")]
    proto = prepare_fp32(proto, lora)
    builders = {"ort_int8_dynamic_all": lambda: quantize_dynamic_model(proto, None, lora),
                "ort_int8_static_all": lambda: quantize_static_model(proto, calibration, None, lora),
                "ort_int8_blockwise_all": lambda: quantize_blockwise_model(proto, lora)}
    out = {}
    for key, build in builders.items():
        start = time.perf_counter()
        model = build()
        path = work / f"{key}.onnx"
        path.write_bytes(model.SerializeToString())
        out[key] = (path, time.perf_counter() - start)
    return out


def quantize_blockwise_model(proto: onnx.ModelProto, keep_fp32_inputs: list[str], bits: int = 8,
                             block_size: int = 128) -> onnx.ModelProto:
    """Blockwise weight-only int8 (``MatMulNBits``, symmetric, ``block_size`` weights per scale) with int8
    compute (accuracy level 4: activations quantised per block), every quantisable MatMul but LoRA's."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from export.int8_quantize import _quiet, quantizable_layers

    copy = onnx.ModelProto()
    copy.CopyFrom(proto)  # the quantiser rewrites the model it is given
    with _quiet():
        quantizer = MatMulNBitsQuantizer(copy, bits=bits, block_size=block_size, is_symmetric=True,
                                         accuracy_level=4,
                                         nodes_to_include=quantizable_layers(copy, list(keep_fp32_inputs)))
        quantizer.process()
    return quantizer.model.model
