"""The update file as the device writes and reads it: checked against a bundle.

The format itself (its metadata table, the size cap, the header check, the strict integer rule,
the escaping of what a file holds) is ``fedmvp_formats.update``, the one reader and writer that
`fedmvp ingest` uses too. This module adds the bundle: an update holds exactly the bundle's LoRA
tensors by the names the bundle uses (``lora.block.attn.to_{q,k,v}.lora_{A,B}.weight``, float32,
the bundle's shapes), its ``bundle_id`` is `Bundle.id`, ``bundle_round`` `Bundle.round` and
``run_id`` `Bundle.run_id` (only when the manifest records it); a file read is capped at the
bundle's LoRA as float32 plus the header cap, and every tensor's span passes the bundle's gate
(``safetensors_check``) before safetensors parses the data. An update is made in memory first
(`update_bytes`: every check a reader makes, before a file, a personalisation or a federation
reply gets it; `parse_update` reads such bytes back). Files are written with
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
    """A read update: LoRA tensors by name and typed metadata."""

    path: Path | None  # None: held in memory (`parse_update`), never written
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


@dataclass(frozen=True)
class Base:
    """The global state an update was trained from and is a delta against: its round and its base digest
    (``fedmvp_formats.promptformer.base_digest``); `fedmvp ingest` finds the round by the digest."""

    round: int | None
    digest: str | None

    @classmethod
    def of_bundle(cls, bundle: Bundle) -> "Base":
        """The bundle's round and state (what the server subtracts from an update trained on its LoRA)."""
        return cls(bundle.round, bundle.base_digest)

    @classmethod
    def of_round(cls, bundle: Bundle, round_number: int, lora: Mapping[str, Any]) -> "Base":
        """A federation round's state: its global ``lora`` over the PromptFormer the bundle holds (synced to
        the round's), round ``round_number``."""
        from fedmvp_formats.promptformer import base_digest

        digest = base_digest(bundle.promptformer_digest, fmt.as_float32(lora)) if bundle.promptformer_digest else None
        return cls(int(round_number), digest)


def update_bytes(tensors: Mapping[str, Any], *, bundle: Bundle, num_examples: int, mean_loss: float,
                 where: str | os.PathLike = "the trained LoRA", base: Base | None = None, **extra: Any) -> bytes:
    """An update for ``bundle`` as the bytes of its file, every check a reader makes done first (names,
    shapes, float32 and finite against the bundle; the metadata as the format types it): what a
    file, a personalisation and (its tensors) a federation reply are made of. ``where`` names it
    in an error (the file's path, or what holds it in memory). ``base``: the state it was trained from
    and is a delta against (default: the bundle's round and state, `Base.of_bundle`)."""
    arrays = fmt.as_float32(tensors)
    check_lora(arrays, bundle.lora_shapes, where, UpdateError)
    base = base or Base.of_bundle(bundle)
    metadata = {"bundle_id": bundle.id, "bundle_round": base.round, "num_examples": int(num_examples),
                "mean_loss": float(mean_loss), "created": utc_now(), "device_id": _device_id(bundle, where),
                **({"base_digest": base.digest} if base.digest else {}),
                **({"run_id": bundle.run_id} if bundle.run_id else {}),
                **({"promptformer_digest": bundle.promptformer_digest} if bundle.promptformer_digest else {}),
                **({"classes_digest": bundle.classes_digest} if bundle.classes_digest else {}), **extra}
    try:
        return fmt.update_bytes(arrays, metadata)
    except UpdateFormatError as err:
        raise UpdateError(f"{where}: {err}") from None


def _device_id(bundle: Bundle, where: str | os.PathLike) -> str:
    """The device's id (``edge_client.device_id``), as the update's error type."""
    from edge_client.device_id import DeviceIdError, device_id

    try:
        return device_id(bundle.path)
    except (DeviceIdError, OSError) as err:
        raise UpdateError(f"{where}: {err}") from None


def write_update(path: str | os.PathLike, tensors: Mapping[str, Any], *, bundle: Bundle, num_examples: int,
                 mean_loss: float, **extra: Any) -> Path:
    """Write an update file for ``bundle`` (`update_bytes`: checked against it) atomically."""
    from edge_client.device_id import keep_device_id

    path = Path(path)
    written = write_bytes(path, update_bytes(tensors, bundle=bundle, num_examples=num_examples, mean_loss=mean_loss,
                                             where=path, **extra))
    keep_device_id(bundle.path)
    return written


def check_lora(tensors: Mapping[str, np.ndarray], shapes: Mapping[str, list[int]], path: str | os.PathLike,
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
    return _against(Update(path=path, tensors=tensors, metadata=metadata), bundle, check_bundle_id, path)


def parse_update(data: bytes, bundle: Bundle, where: str = "the trained LoRA") -> Update:
    """An update held in memory (`update_bytes`), read back as `read_update` reads a file: the format,
    the bundle's names and shapes, this bundle's id. ``Update.path`` is None."""
    try:
        tensors, metadata = fmt.parse_update(data)
    except UpdateFormatError as err:
        raise UpdateError(f"{where}: {err}") from None
    return _against(Update(path=None, tensors=tensors, metadata=metadata), bundle, True, where)


def _against(update: Update, bundle: Bundle | None, check_bundle_id: bool, where: str | os.PathLike) -> Update:
    """``update`` checked against ``bundle`` (or, without one, only finite): `read_update`'s last step."""
    if bundle is not None:
        check_lora(update.tensors, bundle.lora_shapes, where, UpdateError)
        if check_bundle_id and update.bundle_id != bundle.id:
            raise UpdateError(f"{where}: trained on bundle {name_shown(update.bundle_id[:12])}, not on this bundle "
                              f"({bundle.id[:12]}, {bundle.path})")
    else:
        check_lora(update.tensors, shapes_of(update.tensors), where, UpdateError)
    return update
