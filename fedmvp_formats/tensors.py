"""The one tensor check: names, shapes, dtype and finiteness of tensors that arrive from elsewhere.

Every reader of trainable tensors it did not compute itself judges them the same way: a Flower
reply (``fedmvp.federated.replies``), an update file at `fedmvp ingest` (``fedmvp.federated.ingest``)
or on the device (``edge_client.update.check_lora``), a checkpoint written or read
(``fedmvp.runs``). Each caller adds only its own rules (the round's names, the bundle's shapes, a
path in front of the reason, its error type); the wording of a reason is decided here once.
A reason is one line: names a sender chose are escaped and cut short (``fedmvp_formats.shown``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from fedmvp_formats.shown import name_shown

LISTED = 3  # names a reason lists before "and N more"
# A trainable weight (LoRA, PromptFormer) is O(1); one beyond this is no training's: finite, yet its square
# (3e38 squared) is not, so every norm bound and every average it entered would be infinite.
MAX_ABS = 1e4


def listed(names: Sequence[str], first: int = LISTED) -> str:
    """The first names (escaped) and how many more: a reason stays one bounded line."""
    more = f" and {len(names) - first} more" if len(names) > first else ""
    return ", ".join(name_shown(n) for n in names[:first]) + more


def names_problem(names: Iterable[str], wanted: Iterable[str], of: str = "the round") -> str | None:
    """Why ``names`` are not exactly ``wanted`` (what is missing, what is unexpected), or None."""
    names, wanted = set(names), set(wanted)
    if names == wanted:
        return None
    missing, extra = sorted(wanted - names), sorted(names - wanted)
    parts = ([f"missing {listed(missing)}"] if missing else []) + ([f"unexpected {listed(extra)}"] if extra else [])
    return f"tensor names do not match {of} ({'; '.join(parts)})"


def shape_text(shape: Sequence[int]) -> str:
    """A shape as a reason shows it; a shape of absurdly many dimensions only by their count."""
    return str(list(shape)) if len(shape) <= 8 else f"of {len(shape)} dimensions"


def tensor_problem(tensors: Mapping[str, Any], shapes: Mapping[str, Sequence[int]], *, of: str = "the round",
                   dtype: Any = np.float32) -> str | None:
    """Why ``tensors`` are not what ``shapes`` describes, or None. In order, the first that fails:
    names exactly ``shapes``' keys; each tensor's shape; its dtype exactly ``dtype`` (None: any
    floating point); every value finite (one NaN would poison every average it enters) and within
    ``MAX_ABS``. ``of`` names what the shapes are (``the round``, ``the bundle``)."""
    problem = names_problem(tensors, shapes, of)
    if problem is not None:
        return problem
    for name in sorted(tensors):
        value, want = tensors[name], list(shapes[name])
        if list(value.shape) != want:
            return f"{name}: shape {shape_text(value.shape)}, {of}'s is {want}"
        if not np.issubdtype(value.dtype, np.floating) or (dtype is not None and value.dtype != np.dtype(dtype)):
            return f"{name}: dtype {value.dtype} is not {'floating point' if dtype is None else np.dtype(dtype)}"
    return nonfinite_problem(tensors) or magnitude_problem(tensors)


def magnitude_problem(tensors: Mapping[str, Any]) -> str | None:
    """``name: a value of V, beyond MAX_ABS`` for the first tensor (sorted) that holds one, or None."""
    for name in sorted(tensors):
        value = np.asarray(tensors[name])
        largest = float(np.max(np.abs(value))) if value.size else 0.0
        if largest > MAX_ABS:
            return f"{name}: a value of {largest:.3g}, beyond the {MAX_ABS:g} no trained weight reaches"
    return None


def first_nonfinite(tensors: Mapping[str, Any]) -> str | None:
    """The first name (sorted) whose floating-point values hold a NaN or an infinity, or None."""
    for name in sorted(tensors):
        value = np.asarray(tensors[name])
        if np.issubdtype(value.dtype, np.floating) and not np.all(np.isfinite(value)):
            return name
    return None


def nonfinite_problem(tensors: Mapping[str, Any]) -> str | None:
    """``name: holds NaN or infinite values`` for the first such tensor, or None."""
    bad = first_nonfinite(tensors)
    return None if bad is None else f"{bad}: holds NaN or infinite values"


def shapes_of(tensors: Mapping[str, Any]) -> dict[str, list[int]]:
    """Each tensor's own shape: for a check of dtype and values only."""
    return {name: list(value.shape) for name, value in tensors.items()}
