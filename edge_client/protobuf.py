"""Protobuf wire format, read by hand: the few fields of an ONNX file the device needs, without onnx.

Why: the bundle reader (the class list model.onnx pins, the files its external data is read from) and
the in-place refresh (where tensor bytes lie) must not need onnx or onnxruntime. Standard library
only; errors are ValueError.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

MODEL_METADATA = 14  # ModelProto.metadata_props: StringStringEntryProto (key 1, value 2)
# Where a TensorProto can sit (onnx.proto): message -> {field number: the message kind in it}.
_HOLDS = {"model": {7: "graph", 20: "training", 25: "function"}, "training": {1: "graph", 2: "graph"},
          "graph": {1: "node", 5: "tensor", 15: "sparse"}, "node": {5: "attribute"},
          "function": {7: "node", 11: "attribute"}, "sparse": {1: "tensor", 2: "tensor"},
          "attribute": {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"}}
_TENSOR_NAME, _TENSOR_EXTERNAL, _TENSOR_LOCATION, _EXTERNAL = 8, 13, 14, 1  # TensorProto fields; EXTERNAL


def onnx_metadata(path: str | os.PathLike) -> dict[str, str]:
    """ModelProto.metadata_props of an ONNX file, read field by field (the graph is skipped, not read:
    an fp16 model embeds hundreds of MB). Raises ValueError for a file that is not one."""
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
                    if number != MODEL_METADATA:
                        handle.seek(length, os.SEEK_CUR)
                        continue
                    entry = handle.read(length)
                    pair = {n: entry[a:b].decode("utf-8") for n, w, a, b in fields(entry, 0, len(entry)) if w == 2}
                    out[pair.get(1, "")] = pair.get(2, "")
                else:
                    raise ValueError(f"unsupported protobuf wire type {wire}")
    except OSError as err:
        raise ValueError(err.strerror or str(err)) from None
    return out


def onnx_external_data(path: str | os.PathLike) -> list[tuple[str, dict[str, str]]]:
    """(tensor name, its ``external_data`` entries: location, offset, length...) of every tensor of an
    ONNX file kept outside it: initializers, sparse ones, node attributes (Constant), in every subgraph,
    function and training graph. The file is mapped, not read: embedded weights are skipped unread."""
    out: list[tuple[str, dict[str, str]]] = []
    try:
        with open(path, "rb") as handle:
            if os.fstat(handle.fileno()).st_size == 0:
                raise ValueError("empty file")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                todo = [("model", 0, len(data))]  # a stack, not recursion: nesting is the file's to choose
                while todo:
                    kind, start, end = todo.pop()
                    if kind == "tensor":
                        out.extend(_external(data, start, end))
                        continue
                    holds = _HOLDS[kind]
                    todo.extend((holds[n], a, b) for n, w, a, b in fields(data, start, end) if w == 2 and n in holds)
    except OSError as err:
        raise ValueError(err.strerror or str(err)) from None
    return out


def _external(data: bytes | mmap.mmap, start: int, end: int) -> list[tuple[str, dict[str, str]]]:
    """[(name, external_data entries)] of one TensorProto stored as external data, else []."""
    name, entries, location = "", {}, 0
    for number, wire, a, b in fields(data, start, end):
        if number == _TENSOR_NAME and wire == 2:
            name = data[a:b].decode("utf-8")
        elif number == _TENSOR_EXTERNAL and wire == 2:
            pair = {n: data[x:y].decode("utf-8") for n, w, x, y in fields(data, a, b) if w == 2}
            entries[pair.get(1, "")] = pair.get(2, "")
        elif number == _TENSOR_LOCATION and wire == 0:
            location = varint(data, a)[0]
    return [(name, entries)] if entries or location == _EXTERNAL else []


def _read_varint(handle: BinaryIO) -> int:
    """The protobuf varint at the handle's position (the handle is left just after it)."""
    start = handle.tell()
    value, end = varint(handle.read(10), 0)  # a varint is at most 10 bytes
    handle.seek(start + end)
    return value


def varint(data: bytes | mmap.mmap, pos: int) -> tuple[int, int]:
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


def fields(data: bytes | mmap.mmap, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, value start, value end) of each protobuf field in data[start:end]."""
    pos = start
    while pos < end:
        key, pos = varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            after = varint(data, pos)[1]
        elif wire == 1:
            after = pos + 8
        elif wire == 5:
            after = pos + 4
        elif wire == 2:
            length, pos = varint(data, pos)
            after = pos + length
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if after > end:
            raise ValueError("truncated field")
        yield number, wire, pos, after
        pos = after
