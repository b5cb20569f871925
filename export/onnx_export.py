"""ONNX export of the ``EdgeClassifier``: one graph, named LoRA initializers, fp32 / fp16 / int8.

The torch.export-based exporter is used with batch >= 2 and a dynamic ``batch`` dimension
(tracing with batch 1 would specialise it). Its own optimiser is off because it would fold
the LoRA initializers into constants; instead every named initializer is temporarily made a
graph input while onnxscript's optimiser runs, so shapes and constants are folded but every
weight keeps its PyTorch name (``visual.*``, ``prompt.*``, ``text.*``, ``lora.*``). The fp32
model then stores its frozen weights as external data pointing into the bundle's
``weights.safetensors`` (safetensors is raw little-endian data at known offsets, which is
exactly what ONNX external data is), so the ONNX model and the training artifact share one
copy. fp16 / int8 models fold the weight transposes first and embed their converted
weights; their LoRA initializers stay fp32 and un-quantized so the edge swaps the same tensors.
The LoRA initializers are also graph inputs (overridable initializers): ONNX Runtime then
never folds them into constants, so a LoRA given by name at session creation
(``SessionOptions.add_initializer``) or fed with a run really takes effect. The price is that
the rank-r LoRA delta of the attribute keys/values (C*K x width x r) is computed per call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnx import TensorProto, numpy_helper

from edge_client.tensor_layout import safetensors_layout
from export.edge_module import EdgeClassifier

if TYPE_CHECKING:
    from export.int8 import Int8Plan

OPSET = 18
INPUT_NAME = "pixel_values"
OUTPUT_NAMES = ("logits", "probs", "image_embeds")
PRODUCER = "fedmvp-export"
PRECISIONS = ("fp32", "fp16", "int8")


class OnnxExportError(RuntimeError):
    """The ONNX graph could not be produced or does not have the promised shape."""


@contextlib.contextmanager
def no_mha_fastpath() -> Iterator[None]:
    """nn.MultiheadAttention's fused fast path (taken when nothing needs grad) does not export."""
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


@contextlib.contextmanager
def _as_inputs(model: ir.Model, names: list[str]) -> Iterator[None]:
    """Make initializers graph inputs for a while: optimisers never fold graph inputs."""
    values = [model.graph.initializers[n] for n in names if n in model.graph.initializers]
    model.graph.inputs.extend(values)
    try:
        yield
    finally:
        for value in values:
            model.graph.inputs.remove(value)


def _optimize(model: ir.Model, keep: list[str]) -> None:
    import logging

    from onnxscript import optimizer

    quiet = logging.getLogger("onnxscript")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with _as_inputs(model, keep):
            optimizer.optimize(model)
    finally:
        quiet.setLevel(level)


def export_ir(edge: EdgeClassifier, image_size: int, batch: int = 2) -> ir.Model:
    """Trace ``edge`` with a dynamic batch; every named weight survives as an initializer."""
    if batch < 2:
        raise ValueError("trace with batch >= 2, or the exporter fixes the batch dimension")
    example = torch.zeros(batch, 3, image_size, image_size)
    dims = ({0: torch.export.Dim("batch", min=1, max=1 << 16)},)
    with no_mha_fastpath(), torch.no_grad():
        program = torch.onnx.export(edge, (example,), None, input_names=[INPUT_NAME],
                                    output_names=list(OUTPUT_NAMES), dynamic_shapes=dims,
                                    opset_version=OPSET, dynamo=True, optimize=False, verbose=False)
    model = program.model
    _optimize(model, list(model.graph.initializers))
    missing = [n for n in edge.lora_names if n not in model.graph.initializers]
    if missing:
        raise OnnxExportError(f"LoRA tensors missing from the ONNX graph: {', '.join(missing)}")
    # Overridable initializers (also graph inputs, with the initializer as default value): ONNX
    # Runtime never constant-folds them, so a LoRA swapped in by name at session creation
    # (SessionOptions.add_initializer) or fed per run takes effect, and no tool folds them away.
    model.graph.inputs.extend(model.graph.initializers[n] for n in edge.lora_names)
    return model


def to_proto(model: ir.Model) -> onnx.ModelProto:
    """A clean, reproducible ModelProto: fixed producer, no stack traces or source paths."""
    proto = ir.serde.serialize_model(model)
    proto.producer_name, proto.producer_version, proto.doc_string = PRODUCER, "1", ""
    del proto.metadata_props[:]
    graphs = [proto.graph, *(f for f in proto.functions)]
    for graph in graphs:
        for node in graph.node:
            del node.metadata_props[:]
            node.doc_string = ""
    for value in (*proto.graph.input, *proto.graph.output, *proto.graph.value_info):
        del value.metadata_props[:]
    for init in proto.graph.initializer:
        del init.metadata_props[:]
        init.doc_string = ""
    return proto


def pin_classes(proto: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """Record the class list's sha256 in the model's metadata (``fedmvp.classes_sha256``).

    Why: manifest.json is hashed by nothing, model.onnx is; the device refuses a manifest whose
    class list is not this one (relabelled predictions)."""
    from edge_client.bundle import CLASSES_KEY, classes_digest

    for entry in list(proto.metadata_props):
        if entry.key == CLASSES_KEY:
            proto.metadata_props.remove(entry)
    entry = proto.metadata_props.add()
    entry.key, entry.value = CLASSES_KEY, classes_digest(names)
    return proto


def link_external(proto: onnx.ModelProto, weights: Path) -> int:
    """Point fp32 initializers whose bytes are in ``weights`` there instead of embedding them.

    Only tensors whose name, dtype, shape and bytes match are linked; returns bytes linked."""
    table = safetensors_layout(weights)
    linked = 0
    with open(weights, "rb") as handle:
        for init in proto.graph.initializer:
            span = table.get(init.name)
            if span is None or init.data_type != TensorProto.FLOAT or span.dtype != "F32":
                continue
            shape, offset, length = list(span.shape), span.offset, span.length
            data = numpy_helper.to_array(init).astype("<f4", copy=False).tobytes()
            handle.seek(offset)
            if list(init.dims) != list(shape) or len(data) != length or handle.read(length) != data:
                continue
            init.ClearField("raw_data")
            init.ClearField("float_data")
            init.data_location = TensorProto.EXTERNAL
            del init.external_data[:]
            for key, value in (("location", weights.name), ("offset", str(offset)), ("length", str(length))):
                init.external_data.add(key=key, value=value)
            linked += length
    return linked


def external_names(proto: onnx.ModelProto) -> set[str]:
    """Initializers read from external data (what rewriting the weights file in place updates)."""
    return {init.name for init in proto.graph.initializer if init.data_location == TensorProto.EXTERNAL}


def save(proto: onnx.ModelProto, path: Path) -> None:
    """Write ``proto`` as it is (external references kept, nothing moved)."""
    path.write_bytes(proto.SerializeToString(deterministic=True))


def check(path: Path) -> None:
    """onnx.checker on the saved file (external data resolved next to it)."""
    try:
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else "invalid model"
        raise OnnxExportError(f"{path}: onnx.checker failed: {first}") from err


# ---- reduced precision ----------------------------------------------------------------------------
def _sorted(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Topologically sorted and cleaned (converters append cast nodes at the end)."""
    model = ir.serde.deserialize_model(proto)
    model.graph.sort()
    out = to_proto(model)
    onnx.checker.check_model(out)
    return out


def _folded(model: ir.Model, lora_names: list[str]) -> onnx.ModelProto:
    """Weight transposes folded into initializers (what quantizers look for); LoRA left alone."""
    clone = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    _optimize(clone, lora_names)
    return to_proto(clone)


def _check_lora_fp32(proto: onnx.ModelProto, lora_names: list[str], step: str) -> None:
    kinds = {i.name: i.data_type for i in proto.graph.initializer}
    bad = [n for n in lora_names if kinds.get(n) != TensorProto.FLOAT]
    if bad:
        raise OnnxExportError(f"{step} changed the LoRA initializers (must stay fp32): {', '.join(bad)}")


def to_fp16(model: ir.Model, lora_names: list[str]) -> onnx.ModelProto:
    """fp16 weights and compute; graph inputs (pixel_values and the LoRA initializers) stay fp32."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    proto = convert_float_to_float16(_folded(model, lora_names), keep_io_types=True)
    _check_lora_fp32(proto, lora_names, "fp16 conversion")
    return _sorted(proto)


def to_int8(model: ir.Model, lora_names: list[str], calibration: np.ndarray, reference: np.ndarray,
            target: float, progress=None, edge: EdgeClassifier | None = None) -> tuple[onnx.ModelProto, "Int8Plan"]:
    """Dynamic int8 of the MatMul weights, the layers that would flip predictions kept fp32 (export/int8.py).

    ``calibration``: images, ``reference``: the fp32 model's logits on them. LoRA MatMuls are
    never quantised (their weights are graph inputs, and the edge swaps them as fp32).
    ``edge``: the torch module ``model`` was exported from; with it the layers are ranked by a
    first-order estimate (export/int8_sensitivity.py) instead of one ONNX run per layer."""
    from export.int8 import matmuls_as_matmul, plan_int8, quantizable_layers

    proto = matmuls_as_matmul(_folded(model, lora_names))
    shifts = None
    if edge is not None:
        from export.int8_sensitivity import FIRST_ORDER_IMAGES, layer_shifts

        images = torch.from_numpy(calibration[:FIRST_ORDER_IMAGES])
        if progress:
            progress("int8: first-order sensitivity")
        shifts = layer_shifts(edge, images, proto, quantizable_layers(proto, lora_names))
    out, plan = plan_int8(proto, lora_names, reference, calibration_runner(calibration), target, progress, shifts)
    _check_lora_fp32(out, lora_names, "int8 quantisation")
    return _sorted(out), plan


def calibration_runner(calibration: np.ndarray):
    """``export.int8.Run`` over ``calibration``: a candidate's logits on its first ``limit`` images."""
    import tempfile

    from export import parity

    def run(candidate: onnx.ModelProto, limit: int | None) -> np.ndarray:
        with tempfile.TemporaryDirectory(prefix="fedmvp-int8-") as work:
            path = Path(work) / "candidate.onnx"
            save(candidate, path)
            return parity.onnx_outputs(path, calibration[:limit])["logits"]
    return run
