"""Hostile bundle files, shaped as an attacker who controls the server (and so the manifest) would.

Each builder starts from a real exported file and changes only what its attack needs; `resign`
then makes the manifest agree with the tampered file, so a row reaches the parser it attacks
instead of stopping at a hash mismatch.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import struct
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

PROGRAM_PREFIX = "train/"  # the directory torch.export.save puts every entry under


def resign(bundle: Path, name: str) -> None:
    """The manifest's sha256 and bytes of ``name`` made to match the file (followed where it is a link)."""
    path = bundle / "manifest.json"
    manifest = json.loads(path.read_text())
    data = (bundle / name).read_bytes()
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    path.write_text(json.dumps(manifest))


def resign_personalised(bundle: Path) -> Path:
    """state.json of personalised/ made to match its (tampered) active LoRA file; returns that file."""
    state_path = bundle / "personalised" / "state.json"
    state = json.loads(state_path.read_text())
    lora = bundle / "personalised" / state["active"]["file"]
    state["active"].update(sha256=hashlib.sha256(lora.read_bytes()).hexdigest(), bytes=lora.stat().st_size)
    state_path.write_text(json.dumps(state))
    return lora


# ---- safetensors -------------------------------------------------------------------------------------
def split_safetensors(data: bytes) -> tuple[dict, bytes]:
    """(header, data section) of a safetensors file."""
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + size]), data[8 + size:]


def join_safetensors(header: dict | bytes, body: bytes) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def _edit_first(change: Callable[[dict, list[str]], None]) -> Callable[[bytes], bytes]:
    """An attack that edits the header's tensor entries (their names sorted by data offset)."""
    def attack(data: bytes) -> bytes:
        header, body = split_safetensors(data)
        names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        change(header, names)
        return join_safetensors(header, body)
    return attack


def _overlap(header: dict, names: list[str]) -> None:
    header[names[1]]["data_offsets"] = list(header[names[0]]["data_offsets"])


def _huge_shape(header: dict, names: list[str]) -> None:
    header[names[0]]["shape"] = [2 ** 20, 2 ** 20]  # 4 TiB of float32 over a span of a few KB


def _dtype(header: dict, names: list[str]) -> None:
    header[names[0]]["dtype"] = "I32"  # same itemsize: the span still fits, the values are reinterpreted


def _nested(data: bytes) -> bytes:
    deep = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    return join_safetensors(deep, split_safetensors(data)[1])


# attack -> (builder, the start of the reason the device gives)
SAFETENSORS_ATTACKS: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "huge-header-length": (lambda d: struct.pack("<Q", 2 ** 63 - 1) + d[8:], "header length"),
    "header-length-past-end": (lambda d: struct.pack("<Q", len(d)) + d[8:], "header length"),
    "overlapping-offsets": (_edit_first(_overlap), "tensor"),
    "terabyte-shape": (_edit_first(_huge_shape), "tensor"),
    "unexpected-dtype": (_edit_first(_dtype), "tensor"),
    "header-not-json": (lambda d: d[:8] + b"\xff" * (len(d) - 8), "header is not"),
    "deeply-nested-json": (_nested, "header is not"),
}


def tamper_safetensors(path: Path, attack: str) -> None:
    path.write_bytes(SAFETENSORS_ATTACKS[attack][0](path.read_bytes()))


# ---- model.onnx ---------------------------------------------------------------------------------------
def relocate_external(model: Path, location: str) -> None:
    """model.onnx with its first external initializer read from ``location`` (same offset and length)."""
    import onnx

    proto = onnx.load(str(model), load_external_data=False)
    tensor = next(t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    next(e for e in tensor.external_data if e.key == "location").value = location
    model.write_bytes(proto.SerializeToString())


def external_model(location: str, offset: int = 0, length: int = 16):
    """A one-Add ONNX model (x + w) whose w (4 floats) is external data at ``location``."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.zeros(4, np.float32), "w")
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = w.external_data.add()
        entry.key, entry.value = key, value
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    assert isinstance(model, onnx.ModelProto)
    return model


# ---- train.pt2 ----------------------------------------------------------------------------------------
class Touch:
    """Unpickling this creates ``marker``: the code an attacker's pickle would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))


def payload(marker: Path) -> bytes:
    return pickle.dumps(Touch(marker))


def program_entries(source: Path) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(source) as archive:
        return [(info.filename, archive.read(info)) for info in archive.infolist()]


def write_program(path: Path, entries: list[tuple[str, bytes]], compress: dict[str, int] | None = None) -> None:
    """A zip of ``entries`` in order (stored, unless ``compress`` names another method for an entry)."""
    with zipfile.ZipFile(path, "w") as archive, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a name twice is what some rows are about
        for name, data in entries:
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.compress_type = (compress or {}).get(name, zipfile.ZIP_STORED)
            archive.writestr(info, data)


def replace_entry(entries: list[tuple[str, bytes]], name: str, data: bytes) -> list[tuple[str, bytes]]:
    return [(n, data if n == name else d) for n, d in entries]


def pickled_weight_config() -> bytes:
    """A weights config (torch's own schema) saying weight ``w`` is the pickle at data/weights/weight_0."""
    return json.dumps({"config": {"w": {"path_name": "weight_0", "is_param": False, "use_pickle": True,
                                         "tensor_meta": None}}}).encode()


def declare_size(path: Path, name: str, size: int) -> None:
    """Rewrite the central directory so entry ``name`` declares ``size`` uncompressed bytes."""
    data = bytearray(path.read_bytes())
    at = data.find(b"PK\x01\x02")
    while at >= 0:
        name_length = struct.unpack_from("<H", data, at + 28)[0]
        if bytes(data[at + 46:at + 46 + name_length]) == name.encode():
            struct.pack_into("<I", data, at + 24, size)
            path.write_bytes(bytes(data))
            return
        at = data.find(b"PK\x01\x02", at + 4)
    raise KeyError(name)


def deflated_blob(size: int) -> bytes:
    """``size`` bytes of JSON whitespace: deflates about a thousandfold."""
    return b" " * size
