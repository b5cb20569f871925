"""The update file: what `edge-client train` produces and a federation server aggregates.

One safetensors file holding exactly the bundle's LoRA tensors, by the names the bundle uses
(``lora.block.attn.to_{q,k,v}.lora_{A,B}.weight``, float32, the bundle's shapes), and string
metadata:

=================  =====================================================================
``format``         ``fedmvp-edge-update``
``format_version`` ``1``
``bundle_id``      `Bundle.id`: sha256 of the bundle's ``manifest.json`` (which hashes every file)
``bundle_round``   `Bundle.round`: the federated round the bundle was exported from
``run_id``         `Bundle.run_id`: the run it was exported from (only when the manifest records it)
``num_examples``   local images trained on (the FedAvg weight)
``mean_loss``      mean training loss over every step (CE + alpha * L_con)
``final_loss``     mean loss of the last epoch
``epochs``         local epochs
``created``        UTC time the file was written, ISO 8601
``train_seconds``  wall time of the training
``classes``        JSON list of the local class names that had images
``device``         where it trained (``cpu``, ``cuda``)
=================  =====================================================================

Numbers are stored as decimal strings (safetensors metadata is str -> str). Only numpy,
safetensors and the standard library are used: the server and the smallest install read it.
`fedmvp ingest` reads the format on its own (fedmvp/federated/ingest.py: ``fedmvp`` does not import
this package), so a change here is a change there: a new format_version for both.
Files are written with ``edge_client.atomic`` (temp file, fsync, rename), so a reader never
sees half a file. A file read is untrusted: refused on its size before it is read (the bundle's
LoRA as float32 plus a header of at most ``MAX_HEADER_BYTES``), its header checked before
safetensors parses it (length, JSON without repeated keys, str -> str metadata, float32 only),
numbers in one spelling (``str(int)``), and every value it holds shown escaped and cut short in
an error (`_shown`). Unknown metadata keys are allowed (a newer writer's) and never echoed.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.atomic import write_bytes
from edge_client.bundle import Bundle
from edge_client.safetensors_check import check_safetensors

FORMAT = "fedmvp-edge-update"
FORMAT_VERSION = 1
LORA_PREFIX = "lora."
_INT_FIELDS = ("format_version", "bundle_round", "num_examples", "epochs")
_FLOAT_FIELDS = ("mean_loss", "final_loss", "train_seconds")
REQUIRED = ("format", "format_version", "bundle_id", "bundle_round", "num_examples", "mean_loss", "created")
MAX_HEADER_BYTES = 1 << 20  # names, shapes and metadata (a class list) are KBs; fedmvp's ingest reads the same
MAX_UPDATE_BYTES = 64 << 20  # without a bundle to size it by


class UpdateError(ValueError):
    """An update file that cannot be used; one line naming the path."""


def utc_now() -> str:
    """UTC now as ISO 8601 with a ``Z`` (the ``created`` and ``applied`` stamps)."""
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


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


def _encode(metadata: Mapping[str, Any]) -> dict[str, str]:
    """Metadata as strings (safetensors metadata is str -> str); lists/dicts as JSON."""
    out: dict[str, str] = {}
    for key, value in metadata.items():
        if value is None:
            out[key] = ""  # e.g. a bundle that records no round
        elif isinstance(value, (list, tuple, dict)):
            out[key] = json.dumps(value, sort_keys=True)
        elif isinstance(value, float):
            out[key] = repr(float(value))
        else:
            out[key] = str(value)
    return out


def _decode(raw: Mapping[str, str], path: Path) -> dict[str, Any]:
    """The inverse of `_encode` for the known numeric and list fields; a bad number is an `UpdateError`."""
    out: dict[str, Any] = dict(raw)
    for key in _INT_FIELDS:
        if key in out and out[key] not in ("", "None"):
            if not re.fullmatch(r"0|-?[1-9][0-9]{0,17}", out[key]):  # str(int)'s spelling only
                raise UpdateError(f"{path}: malformed metadata ({key} {_shown(out[key])} is not an integer)")
            out[key] = int(out[key])
        elif key in out:
            out[key] = None
    for key in _FLOAT_FIELDS:
        if key in out:
            try:
                out[key] = float(out[key])
            except ValueError:
                raise UpdateError(f"{path}: malformed metadata ({key} {_shown(out[key])} is not a number)") from None
    if "classes" in out:
        try:
            out["classes"] = json.loads(out["classes"])
        except (ValueError, RecursionError):
            raise UpdateError(f"{path}: malformed metadata (classes is not a JSON list)") from None
    return out


def _as_float32(tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """numpy or torch tensors -> contiguous float32 numpy (the update format's only dtype)."""
    out = {}
    for name, value in tensors.items():
        if hasattr(value, "detach"):  # a torch tensor: no torch import needed to convert it
            value = value.detach().float().cpu().numpy()
        out[name] = np.ascontiguousarray(np.asarray(value, dtype=np.float32))
    return out


def write_update(path: str | os.PathLike, tensors: Mapping[str, Any], *, bundle: Bundle, num_examples: int,
                 mean_loss: float, **extra: Any) -> Path:
    """Write an update file for ``bundle`` (names and shapes checked against it) atomically."""
    from safetensors.numpy import save

    path = Path(path)
    arrays = _as_float32(tensors)
    check_lora(arrays, bundle.lora_shapes, path, UpdateError)
    metadata = {"format": FORMAT, "format_version": FORMAT_VERSION, "bundle_id": bundle.id,
                "bundle_round": bundle.round, "num_examples": int(num_examples),
                "mean_loss": float(mean_loss), "created": utc_now(),
                **({"run_id": bundle.run_id} if bundle.run_id else {}), **extra}
    _check_weight(metadata, path)
    return write_bytes(path, save(arrays, metadata=_encode(metadata)))


def check_lora(tensors: Mapping[str, np.ndarray], shapes: Mapping[str, list[int]], path: Path,
               error: type[ValueError]) -> None:
    """Names exactly the bundle's LoRA names, shapes equal, float32, all finite."""
    names, expected = set(tensors), set(shapes)
    if names != expected:
        parts = []
        for what, which in (("missing", sorted(expected - names)), ("unexpected", sorted(names - expected))):
            if which:
                more = f" and {len(which) - 3} more" if len(which) > 3 else ""
                parts.append(f"{what} {', '.join(_shown(n, plain=True) for n in which[:3])}{more}")
        raise error(f"{path}: LoRA tensor names do not match the bundle ({'; '.join(parts)})")
    for name in sorted(names):
        value = tensors[name]
        if list(value.shape) != list(shapes[name]):
            raise error(f"{path}: {name} has shape {list(value.shape)}, the bundle needs {list(shapes[name])}")
        if value.dtype != np.float32:
            raise error(f"{path}: {name} is {value.dtype}, expected float32")
        if not np.all(np.isfinite(value)):
            raise error(f"{path}: {name} holds NaN or infinite values")


def read_update(path: str | os.PathLike, bundle: Bundle | None = None, *, check_bundle_id: bool = True) -> Update:
    """Read and validate an update file.

    Always: the format, the required metadata, only ``lora.*`` tensors, float32, finite.
    With ``bundle``: names and shapes equal the bundle's LoRA and (unless
    ``check_bundle_id=False``) the update was trained on exactly this bundle.
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load

    path = Path(path)
    limit = MAX_UPDATE_BYTES if bundle is None else \
        8 + MAX_HEADER_BYTES + sum(4 * math.prod(shape) for shape in bundle.lora_shapes.values())
    data = _read_bounded(path, limit)  # a size cap first (and no FIFO): nothing huge is read
    try:
        raw = _read_metadata(data)  # the header's JSON, metadata and dtypes
    except ValueError as err:
        raise UpdateError(f"{path}: not a safetensors file ({err})") from None
    check_safetensors(path, UpdateError)  # every tensor's span, before safetensors parses the data
    try:
        tensors = load(data)
    except (SafetensorError, ValueError) as err:
        raise UpdateError(f"{path}: not a safetensors file ({_shown(' '.join(str(err).split()), 120)})") from None
    if raw.get("format") != FORMAT:
        raise UpdateError(f"{path}: not a {FORMAT} file (format {_shown(raw.get('format'))})")
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise UpdateError(f"{path}: metadata lacks {', '.join(missing)}")
    metadata = _decode(raw, path)
    if metadata["format_version"] != FORMAT_VERSION:
        raise UpdateError(f"{path}: update format version {metadata['format_version']} is not supported "
                          f"(this client reads {FORMAT_VERSION})")
    _check_weight(metadata, path)
    stray = [n for n in tensors if not n.startswith(LORA_PREFIX)]
    if stray:
        shown = ", ".join(_shown(n, plain=True) for n in sorted(stray)[:3])
        raise UpdateError(f"{path}: holds non-LoRA tensors ({shown})")
    update = Update(path=path, tensors=dict(sorted(tensors.items())), metadata=metadata)
    if bundle is not None:
        check_lora(tensors, bundle.lora_shapes, path, UpdateError)
        if check_bundle_id and update.bundle_id != bundle.id:
            raise UpdateError(f"{path}: trained on bundle {_shown(update.bundle_id[:12], plain=True)}, not on this bundle "
                              f"({bundle.id[:12]}, {bundle.path})")
    else:
        check_lora(tensors, {k: list(v.shape) for k, v in tensors.items()}, path, UpdateError)
    return update


def _check_weight(metadata: Mapping[str, Any], path: Path) -> None:
    """``num_examples`` (the FedAvg weight) a positive int and ``mean_loss`` finite: an update with
    no examples or a NaN loss would weigh nothing or poison an average."""
    count = metadata.get("num_examples")
    if not isinstance(count, int) or count <= 0:
        raise UpdateError(f"{path}: num_examples is {count!r}; an update must be trained on at least one image")
    for key in ("mean_loss", "final_loss"):
        if key in metadata and not math.isfinite(metadata[key]):
            raise UpdateError(f"{path}: {key} is {metadata[key]!r}; an update's loss must be finite")


def _read_bounded(path: Path, limit: int) -> bytes:
    """The file's bytes, refused on its size before any is read; opened without blocking, so a FIFO
    is refused, not waited on."""
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise UpdateError(f"{path}: not a regular file")
            data = file.read(limit + 1) if info.st_size <= limit else b""
    except OSError as err:
        raise UpdateError(f"{path}: cannot read ({err.strerror or err})") from None
    if info.st_size > limit or len(data) > limit:
        raise UpdateError(f"{path}: {max(info.st_size, len(data))} bytes, more than the {limit} an update of this "
                          f"bundle can be (its LoRA as float32 and a header of at most {MAX_HEADER_BYTES} bytes)")
    return data


def _read_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` map of a safetensors blob, its header checked before safetensors parses it:
    the length within the blob and ``MAX_HEADER_BYTES``, JSON without a repeated key (two readers
    could see two files), str -> str metadata, every tensor F32. ``ValueError`` says what is wrong."""
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes: too short")
    size = int.from_bytes(data[:8], "little")
    if not 0 < size <= min(MAX_HEADER_BYTES, len(data) - 8):
        raise ValueError(f"header length {size}: more than the {len(data) - 8} bytes that follow it "
                         f"or the {MAX_HEADER_BYTES}-byte cap")
    try:
        header = json.loads(data[8:8 + size], object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ValueError("header is not valid JSON: nested too deeply") from None
    except ValueError as err:
        raise ValueError(f"header is not valid JSON: {str(err)[:120]}") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise ValueError("__metadata__ is not an object")
    for key, value in meta.items():
        if not isinstance(value, str):
            raise ValueError(f"metadata {_shown(key, plain=True)} is not a string ({type(value).__name__})")
    for name, entry in header.items():
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        if dtype != "F32":
            raise ValueError(f"tensor {_shown(name, plain=True)} has dtype {_shown(dtype)}, not float32 (F32)")
    return meta


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key {_shown(next(k for k in keys if keys.count(k) > 1))}")
    return dict(pairs)


def _shown(value: Any, limit: int = 60, plain: bool = False) -> str:
    """Untrusted text as an error shows it: escaped (``repr``), at most ``limit`` characters; with
    ``plain`` a name made of name characters only is shown as is."""
    text = str(value)
    if plain and re.fullmatch(r"[A-Za-z0-9_.:/-]{1,120}", text):
        return text
    out = repr(text[:limit])
    return out if len(text) <= limit and len(out) <= limit + 3 else out[:limit] + "..."
