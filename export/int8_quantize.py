"""The int8 quantisers: dynamic (MatMulInteger) and static (QDQ, calibrated ranges) of named MatMul layers.

Why apart from the plan (export/int8.py): which layers to keep fp32 is a search over these calls; the
quantisers themselves (and the every-MatMul variants the benchmark times, benchmarks/int8_variants.py)
only wrap ONNX Runtime's with the project's settings: weights s8 per output channel at 7 bits
(``reduce_range``: x86 CPUs without VNNI saturate in the u8 x s8 multiply-add at 8 bits, and the bundle
must behave the same on whatever device runs it), activations u8, LoRA never quantised
(docs/architecture.md, "int8").
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx

from fedmvp_formats.bundle_manifest import INT8_SCHEMES

QUANTIZED_OPS = ("MatMul",)  # Gemm is rewritten to MatMul + Add first (what the quantizer does itself)


class Int8Error(RuntimeError):
    """The model could not be quantised as asked."""


def matmuls_as_matmul(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy with every Gemm rewritten as MatMul (+ Add), so layer names are stable across calls."""
    from onnxruntime.quantization.onnx_model import ONNXModel

    out = onnx.ModelProto()
    out.CopyFrom(proto)
    ONNXModel(out).replace_gemm_with_matmul()
    return out


def quantizable_layers(proto: onnx.ModelProto, keep_fp32_inputs: list[str]) -> list[str]:
    """MatMul nodes with a constant weight, except those reading any of ``keep_fp32_inputs``."""
    constants = {init.name for init in proto.graph.initializer} - set(keep_fp32_inputs)
    keep = set(keep_fp32_inputs)
    return [node.name for node in proto.graph.node
            if node.op_type in QUANTIZED_OPS and len(node.input) == 2 and node.input[1] in constants
            and not set(node.input) & keep]


SCHEMES = INT8_SCHEMES  # what onnx.int8.scheme may say (the manifest's one definition)


def quantize(proto: onnx.ModelProto, layers: list[str], scheme: str = "dynamic",
             calibration: np.ndarray | None = None, cache: Path | None = None) -> onnx.ModelProto:
    """int8 of exactly ``layers`` (per-channel s8 weights, 7-bit range): ``scheme`` "dynamic" (activations
    quantised per call) or "static" (QDQ, activation ranges from ``calibration``; ``cache``: a file that
    keeps the ranges between calls, the augmented fp32 model is run once per plan, not once per attempt)."""
    if not layers:
        out = onnx.ModelProto()
        out.CopyFrom(proto)
        return out
    if scheme == "static":
        if calibration is None:
            raise Int8Error("static int8 needs calibration images")
        # every calibration image (the export's up to 256 training images): on the trained demo 256 gave
        # 98.05% agreement with fp32 against 96.48% from the first 64 (docs/architecture.md, "int8")
        out = quantize_static_model(proto, calibration, list(layers), cache=cache)
        weights = {init.name for init in out.graph.initializer}
        done = sum(node.op_type == "DequantizeLinear" and node.input[0] in weights for node in out.graph.node)
    elif scheme == "dynamic":
        out = _quantize_dynamic(proto, layers)
        done = sum(node.op_type == "MatMulInteger" for node in out.graph.node)
    else:
        raise Int8Error(f"int8 scheme {scheme!r}: choose one of {', '.join(SCHEMES)}")
    if done != len(layers):
        raise Int8Error(f"asked to quantise {len(layers)} MatMul layers ({scheme}), the quantiser did {done}")
    return out


def _quantize_dynamic(proto: onnx.ModelProto, layers: list[str]) -> onnx.ModelProto:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with _quiet(), tempfile.TemporaryDirectory(prefix="fedmvp-int8-") as work:
        src, dst = Path(work) / "fp32.onnx", Path(work) / "int8.onnx"
        src.write_bytes(proto.SerializeToString(deterministic=True))
        quantize_dynamic(src, dst, op_types_to_quantize=list(QUANTIZED_OPS), weight_type=QuantType.QInt8,
                         per_channel=True, reduce_range=True, nodes_to_quantize=list(layers))
        return onnx.load(str(dst))


def quantize_dynamic_model(proto: onnx.ModelProto, layers: list[str] | None = None,
                           keep_fp32_inputs: list[str] = ()) -> onnx.ModelProto:
    """Dynamic int8 (MatMulInteger, activations quantised per call) of ``layers`` (default: every
    quantisable MatMul of ``proto`` not reading ``keep_fp32_inputs``, e.g. the LoRA names).

    ``proto``: weight transposes folded and Gemm rewritten (``export.onnx_export.prepare_fp32``)."""
    return quantize(proto, quantizable_layers(proto, list(keep_fp32_inputs)) if layers is None else layers)


class _Batches:
    """An onnxruntime CalibrationDataReader (it only needs ``get_next``) over images, ``batch`` at a time."""

    def __init__(self, input_name: str, images: np.ndarray, batch: int):
        self.feeds = iter([{input_name: images[i:i + batch]} for i in range(0, len(images), batch)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.feeds, None)


def quantize_static_model(proto: onnx.ModelProto, calibration: np.ndarray, layers: list[str] | None = None,
                          keep_fp32_inputs: list[str] = (), input_name: str | None = None,
                          batch: int = 8, activations: str = "QUInt8", cache: Path | None = None,
                          outputs: bool = False) -> onnx.ModelProto:
    """Static int8 (QDQ): weights s8 per output channel (7-bit range, as the dynamic model), activation
    ranges calibrated once on ``calibration`` (MinMax, u8 per tensor) instead of measured per call.

    Why both: dynamic costs a min/max + quantise of every MatMul input per call, static fixes the
    ranges, so it can be faster but clips images whose activations leave the calibrated range.
    ``outputs``: also quantise each MatMul's output (ONNX Runtime's QLinearMatMul, u8 out); default not
    (MatMulIntegerToFloat, fp32 out): on ViT-B-16 no faster and it rounds every layer's result to u8
    (docs/architecture.md, "int8").
    ``activations``: "QUInt8" (u8 x s8, the x86 kernel without VNNI) or "QInt8". ``cache``: the calibrated
    ranges are read from this file when it exists, else computed and written there (ranges of every
    MatMul input of the fp32 model: the same whichever layers are quantised). ``input_name``: what
    ``calibration`` feeds (default: the first graph input that is not an initializer)."""
    import onnxruntime
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    onnxruntime.set_default_logger_severity(3)  # the calibration session warns about the LoRA graph inputs
    chosen = quantizable_layers(proto, list(keep_fp32_inputs)) if layers is None else list(layers)
    constants = {init.name for init in proto.graph.initializer}
    name = input_name or next(i.name for i in proto.graph.input if i.name not in constants)
    reader = _Batches(name, calibration, batch)
    with _quiet(), tempfile.TemporaryDirectory(prefix="fedmvp-int8-") as work:
        src, dst = Path(work) / "fp32.onnx", Path(work) / "int8.onnx"
        src.write_bytes(proto.SerializeToString(deterministic=True))
        quantize_static(src, dst, reader, quant_format=QuantFormat.QDQ, op_types_to_quantize=list(QUANTIZED_OPS),
                        per_channel=True, reduce_range=True, activation_type=QuantType[activations],
                        weight_type=QuantType.QInt8, nodes_to_quantize=chosen,
                        calibrate_method=CalibrationMethod.MinMax,
                        extra_options={"WeightSymmetric": True, "ActivationSymmetric": False,
                                       "OpTypesToExcludeOutputQuantization": [] if outputs else list(QUANTIZED_OPS)},
                        calibration_cache_path=cache)
        return onnx.load(str(dst))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The quantiser logs advice ("consider pre-processing") on the root logger on every call."""
    loggers = [logging.getLogger(), logging.getLogger("onnxruntime")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
