"""A model state as it travels in a Flower message: one flat float32 array and its layout.

Why one array: Flower stores every ``Array`` of a message as objects of its own (the array and its
chunks), and its SuperLink serves each object with an HTTP request and a database transaction. The
demo's 26 tensors made 51 objects a message, some 250 requests a round, and the SuperLink's CPU was
what a deployed round waited on (the deploy benchmark: a steady round of 5.5 s for 0.8 s of training on 2
cores). Packed, the tensors are one .npy ``bytes`` value (``arrays.tensors``) and a layout beside it, both
folded into the message's one record (``fedmvp_formats.envelope``): a message is 3 objects whatever the
model (docs/architecture.md "Names that travel", docs/benchmarks.md "deploy").

The tensors are concatenated in sorted name order, float32, each C-contiguous; the layout says
where each one is, as the plain lists a Flower ``ConfigRecord`` carries (``names``, each tensor's
``ranks`` and its ``dims`` one after the other), so it stays readable to any Flower tool. A layout
and a packed array that arrive from elsewhere are judged before a byte is used (``read_layout``,
``read_packed``): ``np.load`` would allocate whatever a header declares.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedmvp_formats.messages import ARRAYS, MessageError
from fedmvp_formats.shown import name_shown, shown
from fedmvp_formats.tensors import names_problem, shape_text

PACKED = "tensors"  # the packed .npy bytes: the one key of a message's ``arrays`` record
LAYOUT = "layout"  # the record beside it: where each tensor is in the packed array
NAMES, RANKS, DIMS = "names", "ranks", "dims"
MAX_RANK = 8
MAX_NPY_HEADER = 4096  # np.save writes 128 bytes for a 1-D float32 array
MAX_VALUES = 1 << 31  # 8 GiB of float32: far above any PromptFormer, far below what a size overflow could claim


def pack(state: Mapping[str, np.ndarray]) -> tuple[np.ndarray, dict[str, list]]:
    """(the flat float32 array, its layout) of ``state``, in sorted name order."""
    names = sorted(state)
    arrays = [np.asarray(state[name], dtype=np.float32) for name in names]
    flat = np.concatenate([a.ravel() for a in arrays]) if arrays else np.zeros(0, np.float32)
    layout = {NAMES: names, RANKS: [a.ndim for a in arrays], DIMS: [int(d) for a in arrays for d in a.shape]}
    return np.ascontiguousarray(flat, dtype=np.float32), layout


def packed_records(state: Mapping[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    """A state as a message's records: ``arrays`` (``PACKED``: the .npy bytes of the packed array) and
    its ``layout``; no tensors: no records (``read_wire`` reads their absence as no tensors)."""
    if not state:
        return {}
    flat, layout = pack(state)
    buffer = io.BytesIO()
    np.save(buffer, flat, allow_pickle=False)
    return {ARRAYS: {PACKED: buffer.getvalue()}, LAYOUT: layout}


def read_layout(layout: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape from a layout record, or `MessageError`: distinct string names, a rank
    (0..8) each, and exactly as many non-negative dims as the ranks add up to."""
    if set(layout) != {NAMES, RANKS, DIMS}:
        raise MessageError(f"layout: expected the keys {NAMES}, {RANKS}, {DIMS}, got "
                           f"{', '.join(name_shown(str(k)) for k in sorted(map(str, layout))) or 'none'}")
    names, ranks, dims = (list(layout[key]) if isinstance(layout[key], (list, tuple)) else None
                          for key in (NAMES, RANKS, DIMS))
    if names is None or not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise MessageError("layout: names are not a list of distinct, non-empty strings")
    for key, values, top in ((RANKS, ranks, MAX_RANK), (DIMS, dims, None)):
        if values is None or not all(type(v) is int and v >= 0 and (top is None or v <= top) for v in values):
            raise MessageError(f"layout: {key} is not a list of integers in 0..{top if top else 'n'}")
    if len(ranks) != len(names) or sum(ranks) != len(dims):
        raise MessageError(f"layout: {len(names)} names, {len(ranks)} ranks and {len(dims)} dims do not fit together")
    shapes, at = {}, 0
    for name, rank in zip(names, ranks):
        shapes[name] = tuple(dims[at:at + rank])
        at += rank
    total = values_in(shapes)
    if total > MAX_VALUES:
        raise MessageError(f"layout: {total} values declared, more than {MAX_VALUES} float32s travel in a message")
    return shapes


def values_in(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """How many float32 values the shapes hold (exact integers: no int64 wrap-around)."""
    return sum(math.prod(shape) for shape in shapes.values())


def read_packed(data: bytes, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """The tensors of a packed array's bytes (a .npy, as Flower's ``Array`` holds it), judged first:
    its header (read with a bounded size) must declare float32 of exactly the layout's element count,
    and the bytes after it must be exactly that. Each tensor is a copy of its own. `MessageError` otherwise."""
    count = values_in(shapes)
    stream = io.BytesIO(data)
    try:
        if len(data) > 4 * count + MAX_NPY_HEADER:
            raise ValueError(f"{len(data)} bytes")
        read = {(1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0}[np.lib.format.read_magic(stream)]
        shape, fortran, dtype = read(stream, max_header_size=MAX_NPY_HEADER)
        if tuple(shape) != (count,) or dtype != np.float32 or len(data) - stream.tell() != 4 * count:
            raise ValueError(f"they hold {dtype} {list(shape)} in {len(data) - stream.tell()} bytes")
    except (ValueError, KeyError, TypeError, SyntaxError) as err:
        text = " ".join(str(err).split())
        raise MessageError(f"{PACKED}: the bytes are not a .npy of {count} float32 values "
                           f"({text[:100] if text[:100].isprintable() else shown(text, 100)})") from None
    flat = np.frombuffer(data, np.float32, count, stream.tell())
    out, at = {}, 0
    for name, shape in shapes.items():  # the layout's order: where the sender put each one
        size = math.prod(shape)
        out[name] = flat[at:at + size].reshape(shape).copy()
        at += size
    return out


def read_wire(arrays: Mapping[str, Any] | None, layout: Mapping[str, Any] | None,
              expected: Mapping[str, tuple[int, ...]] | None = None, of: str = "the round") -> dict[str, np.ndarray]:
    """The tensors a message carries: its ``arrays`` record (``PACKED``: .npy bytes; None or empty: no
    tensors) and its ``layout`` record, each judged before it is read: the layout (``read_layout``);
    where ``expected`` is given (a reply the server asked for), names and shapes exactly those; the
    bytes (``read_packed``: their .npy header's dtype and shape, their length). `MessageError` (one line)
    otherwise."""
    arrays = arrays or {}
    if not arrays and layout is None:
        shapes: dict[str, tuple[int, ...]] = {}
    elif set(arrays) != {PACKED} or layout is None:
        raise MessageError(f"{ARRAYS}: expected one {PACKED} value and a {LAYOUT} record, got "
                           f"{len(arrays)} value(s) ({', '.join(name_shown(str(k)) for k in list(arrays)[:3])})"
                           f"{'' if layout is not None else ' and no layout'}")
    else:
        shapes = read_layout(layout)
    if expected is not None:
        problem = names_problem(shapes, expected, of)
        if problem is not None:
            raise MessageError(problem)
        for name in sorted(expected):
            if tuple(shapes[name]) != tuple(expected[name]):
                raise MessageError(f"{name}: shape {shape_text(shapes[name])}, {of}'s is {list(expected[name])}")
    if not shapes:
        return {}
    data = arrays[PACKED]
    if not isinstance(data, bytes):
        raise MessageError(f"{PACKED}: {shown(data, 40)} is not bytes")
    return read_packed(data, shapes)
