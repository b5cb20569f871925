"""Tensors on the wire: Flower ArrayRecords <-> numpy <-> torch, in one place.

Every trainable tensor travels under its stable name (``promptformer.*``, ``lora.*``;
docs/architecture.md "Names that travel"), float32, in sorted order, so a reply's bytes do not
depend on dictionary order.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from fedmvp_formats.promptformer import promptformer_digest  # noqa: F401  (the round's digest, for callers)


def array_record(state: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in sorted(state.items())})


def numpy_state(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in record.items()}


def to_numpy_state(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().float().numpy() for k, v in state.items()}


def to_torch_state(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(v, dtype=np.float32, copy=True)) for k, v in arrays.items()}


def torch_record(state: dict[str, torch.Tensor]) -> ArrayRecord:
    """A model state as the ArrayRecord a message carries."""
    return array_record(to_numpy_state(state))


def record_to_torch(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """A message's ArrayRecord as a model state."""
    return to_torch_state(numpy_state(record))
