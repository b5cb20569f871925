"""ONNX export of the ``EdgeClassifier``: one graph, named LoRA initializers, fp32 / fp16 / int8.

The torch.export-based exporter is used with batch >= 2 and a dynamic ``batch`` dimension
(tracing with batch 1 would specialise it). Its own optimiser is off because it would fold
the LoRA initializers into constants; instead every named initializer is temporarily made a
graph input while onnxscript's optimiser runs, so shapes and constants are folded but every
weight keeps its PyTorch name (``visual.*``, ``prompt.*``, ``text.*``, ``lora.*``). The fp32
model then stores its frozen weights as external data pointing into the bundle's
``weights.safetensors`` (safetensors is raw little-endian data at known offsets, which is
exactly what ONNX external data is), so the ONNX model and the training artifact share one
copy. fp16 / int8 models start from the unfused graph (the int8 quantiser needs plain MatMuls
with constant weights), fold the weight transposes first and embed their converted
weights; their LoRA initializers stay fp32 and un-quantized so the edge swaps the same tensors.
open_clip's attention is traced through `plain_attention` (the same math as
nn.MultiheadAttention, without its seq-first transposes and packed-QKV gather split), so that
the fp32 model can be fused for ONNX Runtime (`fuse_for_ort`, onnxscript's ORT rules):
MultiHeadAttention, SkipLayerNormalization and BiasGelu contrib ops, which ORT's in-session
optimiser does not find itself. The fusion also runs with every initializer a graph input, so
it packs, folds or renames no weight and the external-data links stay byte-identical.
`export_plain_visual` writes the unprompted image encoder the same way (benchmark baseline).
There is no need to run onnxruntime.transformers.optimizer on a bundle model: it finds the same
fusions, and it treats the LoRA initializers as constants and transposes them in place, so its
output no longer loads (initializer shape != graph input shape) and would take a LoRA given on
the device in the wrong layout.
The LoRA initializers are also graph inputs (overridable initializers): ONNX Runtime then
never folds them into constants, so a LoRA given by name at session creation
(``SessionOptions.add_initializer``) or fed with a run really takes effect. The price is that
the rank-r LoRA delta of the attribute keys/values (C*K x width x r) is computed per call.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnx_ir as ir
import torch
import torch.nn.functional as F
from onnx import TensorProto, numpy_helper
from torch import nn

from fedmvp_formats.bundle_manifest import CLASSES_KEY, classes_digest

from edge_client.tensor_layout import safetensors_layout
from export.edge_module import EdgeClassifier, no_mha_fastpath  # noqa: F401 (used here and re-exported)

if TYPE_CHECKING:
    from export.int8 import AccuracyTarget, Int8Plan

OPSET = 18
INPUT_NAME = "pixel_values"
OUTPUT_NAMES = ("logits", "probs", "image_embeds")
PRODUCER = "fedmvp-export"


class OnnxExportError(RuntimeError):
    """The ONNX graph could not be produced or does not have the promised shape."""


def _self_attention(block: nn.Module, q_x: torch.Tensor, k_x: torch.Tensor | None = None,
                    v_x: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """open_clip's batch-first self-attention as ``nn.MultiheadAttention`` computes it, written so
    that the exported graph is the plain Reshape/Transpose/SDPA pattern ORT's fusions recognise
    (the module's own forward adds seq-first transposes and a packed-QKV unsqueeze/gather split)."""
    attn = block.attn
    if k_x is not None or v_x is not None or attn_mask is not None:  # cross / masked: the module's own
        return type(block).attention(block, q_x, k_x, v_x, attn_mask)
    b, s, d = q_x.shape
    heads = attn.num_heads
    qkv = F.linear(q_x, attn.in_proj_weight, attn.in_proj_bias)
    q, k, v = (t.reshape(b, s, heads, d // heads).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    out = F.scaled_dot_product_attention(q, k, v)
    return attn.out_proj(out.transpose(1, 2).reshape(b, s, d))


def _self_attention_blocks(module: nn.Module) -> list[nn.Module]:
    """open_clip residual blocks whose attention is a plain batch-first ``nn.MultiheadAttention``."""
    return [m for m in module.modules() if hasattr(m, "attention") and isinstance(getattr(m, "attn", None),
            nn.MultiheadAttention) and m.attn.batch_first and m.attn._qkv_same_embed_dim
            and not hasattr(m, "ln_1_kv") and not m.attn.add_zero_attn and m.attn.bias_k is None]


@contextlib.contextmanager
def plain_attention(module: nn.Module) -> Iterator[int]:
    """Export open_clip's self-attention blocks through `_self_attention` (same weights, same math)."""
    blocks = _self_attention_blocks(module)
    for block in blocks:
        block.attention = types.MethodType(_self_attention, block)
    try:
        yield len(blocks)
    finally:
        for block in blocks:
            del block.attention


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


def _trace(module: nn.Module, image_size: int, batch: int, output_names: list[str]) -> ir.Model:
    """torch.export-based ONNX of ``module`` (pixel_values -> outputs) with a dynamic batch, every
    initializer kept by name (onnxscript's optimiser folds shapes and constants, never a weight)."""
    if batch < 2:
        raise ValueError("trace with batch >= 2, or the exporter fixes the batch dimension")
    example = torch.zeros(batch, 3, image_size, image_size)
    dims = ({0: torch.export.Dim("batch", min=1, max=1 << 16)},)
    with no_mha_fastpath(), plain_attention(module), torch.no_grad():
        program = torch.onnx.export(module, (example,), None, input_names=[INPUT_NAME],
                                    output_names=output_names, dynamic_shapes=dims,
                                    opset_version=OPSET, dynamo=True, optimize=False, verbose=False)
    model = program.model
    _optimize(model, list(model.graph.initializers))
    return model


def export_ir(edge: EdgeClassifier, image_size: int, batch: int = 2) -> ir.Model:
    """Trace ``edge`` with a dynamic batch; every named weight survives as an initializer."""
    model = _trace(edge, image_size, batch, list(OUTPUT_NAMES))
    missing = [n for n in edge.lora_names if n not in model.graph.initializers]
    if missing:
        raise OnnxExportError(f"LoRA tensors missing from the ONNX graph: {', '.join(missing)}")
    # Overridable initializers (also graph inputs, with the initializer as default value): ONNX
    # Runtime never constant-folds them, so a LoRA swapped in by name at session creation
    # (SessionOptions.add_initializer) or fed per run takes effect, and no tool folds them away.
    model.graph.inputs.extend(model.graph.initializers[n] for n in edge.lora_names)
    return model


class _PlainVisual(nn.Module):
    """pixel_values -> open_clip's unprompted image feature (unnormalised), nothing else."""

    def __init__(self, visual: nn.Module):
        super().__init__()
        self.visual = visual

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.visual(pixel_values)


def export_plain_visual(visual: nn.Module, image_size: int, path: str | Path, fuse: bool = True) -> dict[str, int]:
    """Write the unprompted CLIP image encoder (``pixel_values`` -> ``image_embeds`` [N, E],
    unnormalised) to ``path``, weights embedded, traced and fused like the bundle's fp32 model.

    Why: the "plain CLIP on ONNX Runtime" baseline that the prompted bundle model's cost is
    measured against. Returns `fused_ops` of the written model."""
    model = _trace(_PlainVisual(visual).eval(), image_size, 2, ["image_embeds"])
    if fuse:
        fuse_for_ort(model)
    proto = to_proto(model)
    save(proto, Path(path))
    return fused_ops(proto)


def fuse_for_ort(model: ir.Model) -> dict[str, int]:
    """ONNX Runtime's contrib fusions in place: MultiHeadAttention, SkipLayerNormalization, BiasGelu.

    ORT's in-session optimiser does not find these in the exported graph (it keeps the Erf GELU,
    LayerNorm + residual Add and the Softmax/Transpose attention apart). onnxscript's ORT fusion
    rules do, on the `plain_attention` pattern. Every initializer is a graph input while they run,
    so no weight is folded, packed or renamed: the fp32 model still links each weight into
    weights.safetensors byte for byte, and the LoRA initializers stay overridable. Returns the
    count of each fusion applied (zeros left out)."""
    import logging

    from onnxscript.rewriter.ort_fusions._core import fuse_xformers

    quiet = logging.getLogger("onnxscript")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    inputs = {v.name for v in model.graph.inputs}
    try:
        with _as_inputs(model, [n for n in model.graph.initializers if n not in inputs]):
            _, counts = fuse_xformers(model)
    finally:
        quiet.setLevel(level)
    ir.passes.common.RemoveUnusedNodesPass()(model)  # constants the fused nodes no longer read
    return {name: count for name, count in counts.items() if count}


def fused(model: ir.Model) -> ir.Model:
    """A copy of ``model`` with `fuse_for_ort` applied (the fp32 bundle model); ``model`` is left
    plain for the fp16 / int8 conversions, whose quantiser needs plain MatMuls."""
    clone = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    fuse_for_ort(clone)
    return clone


def fused_ops(proto: onnx.ModelProto) -> dict[str, int]:
    """Count of each ONNX Runtime contrib op (``com.microsoft``) in ``proto``: what `fuse_for_ort` left."""
    counts: dict[str, int] = {}
    for node in proto.graph.node:
        if node.domain == "com.microsoft":
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items()))


def portable_ir_version(proto: onnx.ModelProto) -> int:
    """The lowest IR version the model's opsets need (never below 8, never above what it had).

    Why: a new ``onnx`` writes its own newest IR version (14 with onnx 1.23), and an ONNX Runtime a
    release behind refuses it outright ("Unsupported model IR version: 14, max supported: 13", seen
    on a GPU machine with onnxruntime 1.30) although nothing in the graph needs it.
    """
    needed = onnx.helper.find_min_ir_version_for(list(proto.opset_import), ignore_unknown=True)
    return min(proto.ir_version, max(needed, 8))


def to_proto(model: ir.Model) -> onnx.ModelProto:
    """A clean, reproducible ModelProto: fixed producer, no stack traces or source paths."""
    proto = ir.serde.serialize_model(model)
    proto.producer_name, proto.producer_version, proto.doc_string = PRODUCER, "1", ""
    proto.ir_version = portable_ir_version(proto)
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


def _quantisable(model: ir.Model, lora_names: list[str]) -> onnx.ModelProto:
    """Weight transposes folded into initializers and Gemm as MatMul (what the quantisers need); LoRA left alone."""
    from export.int8 import matmuls_as_matmul

    return matmuls_as_matmul(_folded(model, lora_names))


def prepare_fp32(proto: onnx.ModelProto, lora_names: list[str]) -> onnx.ModelProto:
    """An exported fp32 model (e.g. a bundle's model.onnx, external data loaded) made ready for the
    quantisers, as the exporter's own int8 path prepares its graph (benchmarks build variants on it)."""
    return _quantisable(ir.serde.deserialize_model(proto), lora_names)


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
            target: float, progress=None, edge: EdgeClassifier | None = None,
            accuracy: "AccuracyTarget | None" = None, scheme: str = "auto",
            real_calibration: int | None = None) -> tuple[onnx.ModelProto, "Int8Plan"]:
    """int8 of the MatMul weights, the layers that would flip predictions kept fp32 (export/int8.py).

    ``calibration``: images, ``reference``: the fp32 model's logits on them. LoRA MatMuls are
    never quantised (their weights are graph inputs, and the edge swaps them as fp32).
    ``edge``: the torch module ``model`` was exported from; with it the layers are ranked by a
    first-order estimate (export/int8_sensitivity.py) instead of one ONNX run per layer.
    ``accuracy``: the task accuracy to hold on labelled held-out images (else: agreement >= ``target``).
    ``scheme``: dynamic, static or auto (both planned, the faster at batch 8 here ships; export/int8_scheme.py);
    ``real_calibration``: how many of ``calibration`` are real images (None: all; 0: auto is dynamic)."""
    from export.int8 import quantizable_layers
    from export.int8_scheme import plan_scheme

    proto = _quantisable(model, lora_names)
    shifts = None
    if edge is not None:
        from export.int8_sensitivity import FIRST_ORDER_IMAGES, layer_shifts

        images = torch.from_numpy(calibration[:FIRST_ORDER_IMAGES])
        if progress:
            progress("int8: first-order sensitivity")
        shifts = layer_shifts(edge, images, proto, quantizable_layers(proto, lora_names))
    out, plan = plan_scheme(proto, lora_names, reference, calibration_runner(calibration), target, calibration,
                            scheme, real_calibration, progress, shifts, accuracy)
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
