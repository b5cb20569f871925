"""Where each tensor's bytes lie inside a bundle file (safetensors, ONNX), read without loading it.

Why: a bundle refresh (``edge_client.refresh``) rewrites tensors in place. The fp32 ONNX model
reads its frozen weights as external data at fixed byte offsets into ``weights.safetensors``
(``export.onnx_export.link_external``), so new values must land at exactly the old offsets; and
the LoRA initializers are embedded in ``model.onnx`` as raw little-endian bytes, which can be
overwritten where they lie (same length: no protobuf length prefix moves). Standard library only.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from edge_client.bundle import BundleError

_ONNX_FLOAT = 1  # TensorProto.FLOAT
# Field numbers of onnx.proto: ModelProto.graph, GraphProto.initializer, TensorProto.{dims, data_type, name, raw_data}
_MODEL_GRAPH, _GRAPH_INITIALIZER, _MODEL_METADATA = 7, 5, 14  # ModelProto.metadata_props: key 1, value 2
_TENSOR_DIMS, _TENSOR_TYPE, _TENSOR_NAME, _TENSOR_RAW = 1, 2, 8, 9


@dataclass(frozen=True)
class Span:
    """One tensor's bytes in a file: dtype ("F32", ...), shape, absolute offset and length."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int


def safetensors_layout(path: str | os.PathLike) -> dict[str, Span]:
    """Every tensor of a safetensors file by name, from its header alone."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        start = 8 + size
        return {name: Span(meta["dtype"], tuple(int(d) for d in meta["shape"]), start + meta["data_offsets"][0],
                           meta["data_offsets"][1] - meta["data_offsets"][0])
                for name, meta in header.items() if name != "__metadata__"}
    except (OSError, struct.error, ValueError, KeyError, TypeError, IndexError) as err:
        raise BundleError(f"{path}: not a readable safetensors file ({' '.join(str(err).split())[:200]})") from None


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


def onnx_metadata(path: str | os.PathLike) -> dict[str, str]:
    """ModelProto.metadata_props of an ONNX file, read field by field (the graph is skipped, not read:
    an fp16 model embeds hundreds of MB)."""
    path = Path(path)
    out: dict[str, str] = {}
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            while handle.tell() < size:
                key = _read_varint(handle)
                number, wire = key >> 3, key & 7
                if wire == 0:
                    _read_varint(handle)
                elif wire in (1, 5):
                    handle.seek(8 if wire == 1 else 4, os.SEEK_CUR)
                elif wire == 2:
                    length = _read_varint(handle)
                    if handle.tell() + length > size:
                        raise ValueError("truncated field")
                    if number != _MODEL_METADATA:
                        handle.seek(length, os.SEEK_CUR)
                        continue
                    entry = handle.read(length)
                    pair = {n: entry[a:b].decode("utf-8") for n, w, a, b in _fields(entry, 0, len(entry)) if w == 2}
                    out[pair.get(1, "")] = pair.get(2, "")
                else:
                    raise ValueError(f"unsupported protobuf wire type {wire}")
    except (OSError, ValueError) as err:
        raise BundleError(f"{path}: not a readable ONNX model ({' '.join(str(err).split())[:200]})") from None
    return out


def _read_varint(handle: BinaryIO) -> int:
    """The protobuf varint at the handle's position."""
    value, shift = 0, 0
    while True:
        byte = handle.read(1)
        if not byte or shift > 63:
            raise ValueError("truncated or overlong varint")
        value |= (byte[0] & 0x7F) << shift
        if byte[0] < 0x80:
            return value
        shift += 7


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


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it) of the protobuf varint at ``pos``."""
    value, shift = 0, 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, value start, value end) of each protobuf field in data[start:end]."""
    pos = start
    while pos < end:
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            after = _varint(data, pos)[1]
        elif wire == 1:
            after = pos + 8
        elif wire == 5:
            after = pos + 4
        elif wire == 2:
            length, pos = _varint(data, pos)
            after = pos + length
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if after > end:
            raise ValueError("truncated field")
        yield number, wire, pos, after
        pos = after
