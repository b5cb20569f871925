"""Where each tensor's bytes lie inside a bundle file (safetensors, ONNX), read without loading it.

Why: a bundle refresh (``edge_client.refresh``) rewrites tensors in place. The fp32 ONNX model
reads its frozen weights as external data at fixed byte offsets into ``weights.safetensors``
(``export.onnx_export.link_external``), so new values must land at exactly the old offsets; and
the LoRA initializers are embedded in ``model.onnx`` as raw little-endian bytes, which can be
overwritten where they lie (same length: no protobuf length prefix moves). Standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path

from edge_client.bundle import BundleError
from edge_client.protobuf import fields as _fields
from edge_client.protobuf import varint as _varint
from edge_client.safetensors_check import Span, check_safetensors

_ONNX_FLOAT = 1  # TensorProto.FLOAT
# Field numbers of onnx.proto: ModelProto.graph, GraphProto.initializer, TensorProto.{dims, data_type, name, raw_data}
_MODEL_GRAPH, _GRAPH_INITIALIZER = 7, 5
_TENSOR_DIMS, _TENSOR_TYPE, _TENSOR_NAME, _TENSOR_RAW = 1, 2, 8, 9


def safetensors_layout(path: str | os.PathLike) -> dict[str, Span]:
    """Every tensor of a safetensors file by name, from its header alone (checked: `check_safetensors`)."""
    return check_safetensors(path)


def onnx_initializer_spans(path: str | os.PathLike) -> dict[str, Span]:
    """The main graph's initializers stored as ``raw_data`` (embedded bytes) by name.

    Initializers held as external data or typed fields are left out: they have no raw bytes here."""
    path = Path(path)
    data = path.read_bytes()
    out: dict[str, Span] = {}
    try:
        for number, wire, start, end in _fields(data, 0, len(data)):
            if number != _MODEL_GRAPH or wire != 2:
                continue
            for g_number, g_wire, g_start, g_end in _fields(data, start, end):
                if g_number == _GRAPH_INITIALIZER and g_wire == 2:
                    name, span = _tensor(data, g_start, g_end)
                    if name is not None and span is not None:
                        out[name] = span
    except ValueError as err:
        raise BundleError(f"{path}: not a readable ONNX model ({err})") from None
    return out


def _tensor(data: bytes, start: int, end: int) -> tuple[str | None, Span | None]:
    """(name, span of its raw_data) of one TensorProto."""
    name, dtype, dims, raw = None, None, [], None
    for number, wire, a, b in _fields(data, start, end):
        if number == _TENSOR_NAME and wire == 2:
            name = data[a:b].decode("utf-8")
        elif number == _TENSOR_TYPE and wire == 0:
            dtype = _varint(data, a)[0]
        elif number == _TENSOR_DIMS and wire == 0:
            dims.append(_varint(data, a)[0])
        elif number == _TENSOR_DIMS and wire == 2:  # packed
            pos = a
            while pos < b:
                value, pos = _varint(data, pos)
                dims.append(value)
        elif number == _TENSOR_RAW and wire == 2:
            raw = (a, b - a)
    if raw is None:
        return name, None
    return name, Span("F32" if dtype == _ONNX_FLOAT else f"onnx-{dtype}", tuple(dims), raw[0], raw[1])
