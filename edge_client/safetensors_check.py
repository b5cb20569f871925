"""The one gate every safetensors file of a bundle (and every update file) passes before a library reads it.

Why: whoever controls the server writes the manifest too, so a matching sha256 says nothing about a
header. The safetensors library refuses most malformed headers, but with an exception that names no
file and that the commands do not expect (a traceback), it accepts any dtype, and the ONNX model reads
weights.safetensors at fixed offsets without looking at its header at all. So the header is checked
here first, with the standard library only (the inference install has no torch):

- the 8-byte header length against the file's size and a cap, before anything is allocated for it;
- the header one JSON object (not nested deeper than its format, no key twice), ``__metadata__`` a
  map of strings, every other entry {dtype, shape, data_offsets};
- every tensor F32 (all a bundle or update holds; the check images alone are U8, ``dtypes``) with
  shape * its item size == its data span;
- the spans in bounds, in order, not overlapping, and covering the data exactly.

`load_safetensors` is the checked way to load one, for numpy (inference) or torch (training).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_client.bundle_files import BundleError

MAX_HEADER = 16 << 20  # bytes; a bundle's largest header (every frozen tensor of a ViT) is tens of KB
MAX_DIMS = 8
ITEMSIZE = {"F32": 4}  # the exporter and `edge-client train` write float32 only
CHECK_ITEMSIZE = {"U8": 1}  # the bundle's check images (edge_client/check_images.py): uint8 pictures


@dataclass(frozen=True)
class Span:
    """One tensor's bytes in a file: dtype ("F32", ...), shape, absolute offset and length."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int


def check_safetensors(path: str | os.PathLike, error: type[ValueError] = BundleError,
                      dtypes: dict[str, int] | None = None) -> dict[str, Span]:
    """Every tensor of a safetensors file by name (where its bytes lie), from a header checked as above;
    raises ``error`` (one line naming the file) for anything else. ``dtypes``: the accepted dtypes and their
    item sizes (default ITEMSIZE: float32)."""
    path = Path(path)

    def bad(reason: str) -> ValueError:
        return error(f"{path}: not a safetensors file ({reason})")

    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            head = handle.read(8)
            if len(head) < 8:
                raise bad(f"header length missing: the file has {size} bytes")
            (length,) = struct.unpack("<Q", head)
            if length > size - 8 or length > MAX_HEADER:
                raise bad(f"header length {length} is more than the {size - 8} bytes after it or the "
                          f"{MAX_HEADER}-byte cap")
            raw = handle.read(length)
    except OSError as err:
        raise error(f"{path}: cannot read ({err.strerror or err})") from None
    header = _parse(raw, bad)
    data_size = size - 8 - length
    sizes = ITEMSIZE if dtypes is None else dtypes
    entries = {name: _entry(name, info, data_size, bad, sizes) for name, info in header.items()
               if name != "__metadata__"}
    end = 0
    for name, span in sorted(entries.items(), key=lambda item: (item[1].offset, item[1].length)):
        if span.offset != end:
            what = "overlaps the tensor before it" if span.offset < end else "leaves a gap before it"
            raise bad(f"tensor {name!r}: its data span {what}")
        end = span.offset + span.length
    if end != data_size:
        raise bad(f"tensor data covers {end} of the {data_size} data bytes")
    return {name: Span(s.dtype, s.shape, s.offset + 8 + length, s.length) for name, s in entries.items()}


def load_safetensors(path: str | os.PathLike, error: type[ValueError] = BundleError,
                     framework: str = "numpy", dtypes: dict[str, int] | None = None) -> dict[str, Any]:
    """Tensors of a safetensors file, checked first: numpy arrays, or torch tensors (``framework="pt"``)."""
    from safetensors import SafetensorError

    check_safetensors(path, error, dtypes)
    if framework == "pt":
        from safetensors.torch import load_file
    else:
        from safetensors.numpy import load_file
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise error(f"{path}: not a safetensors file ({' '.join(str(err).split())[:200]})") from None


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object that names no key twice (two parsers could each believe a different one)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a key appears twice")
    return out


def _parse(raw: bytes, bad: Any) -> dict[str, Any]:
    """The header as a JSON object."""
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique)
    except RecursionError:
        raise bad("header is not JSON of the format: nested too deeply") from None
    except ValueError as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise bad(f"header is not JSON ({' '.join(str(err).split())[:120]})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad("header is not of the format: __metadata__ is not a map of strings")
    return header


def _entry(name: str, info: Any, data_size: int, bad: Any, sizes: dict[str, int]) -> Span:
    """One tensor's entry, checked; its offset relative to the data section."""
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise bad(f"tensor {name!r}: its entry is not {{dtype, shape, data_offsets}}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in sizes:
        raise bad(f"tensor {name!r} has dtype {dtype!r}; only {', '.join(sizes)} is accepted")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_count(d) for d in shape):
        raise bad(f"tensor {name!r}: shape {str(shape)[:80]} is not a list of at most {MAX_DIMS} sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(o) for o in offsets) \
            or not offsets[0] <= offsets[1] <= data_size:
        raise bad(f"tensor {name!r}: data span {str(offsets)[:80]} is not within the {data_size} data bytes")
    need = math.prod(shape) * sizes[dtype]
    if need != offsets[1] - offsets[0]:
        raise bad(f"tensor {name!r}: shape {shape} of {dtype} needs {need} bytes, its data span holds "
                  f"{offsets[1] - offsets[0]}")
    return Span(dtype, tuple(shape), offsets[0], offsets[1] - offsets[0])


def _count(value: Any) -> bool:
    """A non-negative int (JSON true/false are not sizes)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
