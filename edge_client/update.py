"""The update file as the device writes and reads it: checked against a bundle.

The format itself (its metadata table, the size cap, the header check, the strict integer rule,
the escaping of what a file holds) is ``fedmvp_formats.update``, the one reader and writer that
`fedmvp ingest` uses too. This module adds the bundle: an update holds exactly the bundle's LoRA
tensors by the names the bundle uses (``lora.block.attn.to_{q,k,v}.lora_{A,B}.weight``, float32,
the bundle's shapes), its ``bundle_id`` is `Bundle.id`, ``bundle_round`` `Bundle.round` and
``run_id`` `Bundle.run_id` (only when the manifest records it); a file read is capped at the
bundle's LoRA as float32 plus the header cap, and every tensor's span passes the bundle's gate
(``safetensors_check``) before safetensors parses the data. Files are written with
``fedmvp_formats.atomic`` (temp file, fsync, rename), so a reader never sees half a file.
Only numpy, safetensors and the standard library are used: the smallest install reads it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedmvp_formats import update as fmt
from fedmvp_formats.atomic import write_bytes
from fedmvp_formats.names import LORA_PREFIX  # noqa: F401  (the names an update holds)
from fedmvp_formats.shown import name_shown
from fedmvp_formats.tensors import shapes_of, tensor_problem
from fedmvp_formats.update import (FORMAT, FORMAT_VERSION, MAX_HEADER_BYTES, MAX_UPDATE_BYTES,  # noqa: F401
                                   REQUIRED, UpdateFormatError, utc_now)

from edge_client.bundle import Bundle
from edge_client.safetensors_check import check_safetensors


class UpdateError(ValueError):
    """An update file that cannot be used; one line naming the path."""


@dataclass
class Update:
    """A read update file: LoRA tensors by name and typed metadata."""

    path: Path
    tensors: dict[str, np.ndarray]
    metadata: dict[str, Any]

    @property
    def bundle_id(self) -> str:
        """`Bundle.id` of the bundle this update was trained on."""
        return str(self.metadata["bundle_id"])

    @property
    def round(self) -> int | None:
        """`Bundle.round` of that bundle (None if it recorded none)."""
        return self.metadata.get("bundle_round")

    @property
    def num_examples(self) -> int:
        """Local images trained on: the update's FedAvg weight."""
        return int(self.metadata["num_examples"])

    @property
    def mean_loss(self) -> float:
        """Mean training loss over every step."""
        return float(self.metadata["mean_loss"])


def write_update(path: str | os.PathLike, tensors: Mapping[str, Any], *, bundle: Bundle, num_examples: int,
                 mean_loss: float, **extra: Any) -> Path:
    """Write an update file for ``bundle`` (names and shapes checked against it) atomically."""
    path = Path(path)
    arrays = fmt.as_float32(tensors)
    check_lora(arrays, bundle.lora_shapes, path, UpdateError)
    metadata = {"bundle_id": bundle.id, "bundle_round": bundle.round, "num_examples": int(num_examples),
                "mean_loss": float(mean_loss), "created": utc_now(),
                **({"run_id": bundle.run_id} if bundle.run_id else {}), **extra}
    try:
        data = fmt.update_bytes(arrays, metadata)
    except UpdateFormatError as err:
        raise UpdateError(f"{path}: {err}") from None
    return write_bytes(path, data)


def check_lora(tensors: Mapping[str, np.ndarray], shapes: Mapping[str, list[int]], path: Path,
               error: type[ValueError]) -> None:
    """Names exactly the bundle's LoRA names, its shapes, float32, all finite (the one tensor check,
    ``fedmvp_formats.tensors``); the bundle adds its path in front and its error type."""
    problem = tensor_problem(tensors, shapes, of="the bundle")
    if problem is not None:
        raise error(f"{path}: {problem}")


def read_update(path: str | os.PathLike, bundle: Bundle | None = None, *, check_bundle_id: bool = True) -> Update:
    """Read and validate an update file (``fedmvp_formats.update``: the format, its metadata, only
    ``lora.*`` float32 tensors). Always finite; with ``bundle``: names and shapes equal the bundle's
    LoRA and (unless ``check_bundle_id=False``) the update was trained on exactly this bundle."""
    path = Path(path)
    limit = MAX_UPDATE_BYTES if bundle is None else fmt.size_limit(bundle.lora_shapes.values())
    try:
        tensors, metadata = fmt.read_update_file(path, limit, "this bundle",
                                                 checked=lambda _: check_safetensors(path, UpdateError))
    except UpdateFormatError as err:
        raise UpdateError(f"{path}: {err}") from None
    update = Update(path=path, tensors=tensors, metadata=metadata)
    if bundle is not None:
        check_lora(tensors, bundle.lora_shapes, path, UpdateError)
        if check_bundle_id and update.bundle_id != bundle.id:
            raise UpdateError(f"{path}: trained on bundle {name_shown(update.bundle_id[:12])}, not on this bundle "
                              f"({bundle.id[:12]}, {bundle.path})")
    else:
        check_lora(tensors, shapes_of(tensors), path, UpdateError)
    return update
