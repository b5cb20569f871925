"""The update file: what `edge-client train` writes and `fedmvp ingest` (or a device) reads.

One safetensors file holding exactly a bundle's LoRA tensors (``lora.*``, float32) and string
metadata (safetensors metadata is str -> str; numbers as decimal strings, lists as JSON): the keys
and their meaning are ``FIELDS`` (docs/reference/update-file.md is generated from it).

One reader and one writer, here, for both sides. A file read is untrusted: refused on its size
before it is read (`read_bounded`), its header checked before safetensors parses it
(`check_header`: length, JSON without repeated keys, str -> str metadata, float32 only), numbers
in one spelling (`integer`), only ``lora.*`` tensors, and every value it holds shown escaped and
cut short in an error (``fedmvp_formats.shown``). Unknown metadata keys are allowed (a newer
writer's) and never echoed. Errors are `UpdateFormatError`s without the path: each caller adds it
(the device's ``UpdateError``, ingest's rejection reason). What a bundle or a run adds (names and
shapes, staleness, run id, norm bound) is checked by the caller.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from fedmvp_formats.bounds import MAX_LOSS, MAX_SECONDS
from fedmvp_formats.names import LORA_PREFIX
from fedmvp_formats.shown import name_shown, shown

FORMAT = "fedmvp-edge-update"
FORMAT_VERSION = 1
FIELDS: dict[str, str] = {  # metadata key: its meaning
    "format": f"``{FORMAT}``",
    "format_version": f"``{FORMAT_VERSION}``",
    "bundle_id": "the bundle's id: sha256 of its ``manifest.json`` (which hashes every file); a region's update "
                 "(``region_run_id``): sha256 of the central round's ``global.safetensors`` it started from",
    "bundle_round": "the federated round the bundle was exported from (empty: none recorded)",
    "run_id": "the run its weights come from: the manifest's ``source.run_id`` (after a refresh from another "
              "run, that run; only when the manifest records one)",
    "promptformer_digest": "the PromptFormer it was trained over (``fedmvp_formats.promptformer``, the bundle's "
                           "``promptformer.digest``): `fedmvp ingest` checks it against the run's round "
                           "``bundle_round`` and refuses an update without it",
    "base_digest": "the global state it was trained from, which its values are a delta against: "
                   "``fedmvp_formats.promptformer.base_digest`` of that round's PromptFormer and LoRA (the bundle's "
                   "``source.base_digest``, or the state a federation message sent): `fedmvp ingest` takes the round "
                   "whose state this is as the update's base (and its staleness from it) and refuses an update "
                   "without it or naming none of the run's rounds",
    "classes_digest": "the class set its labels index (``fedmvp_formats.class_set``, the bundle's "
                      "``classes.digest``; only when the manifest records it)",
    "num_examples": "local images trained on (the FedAvg weight)",
    "mean_loss": "mean training loss over every step (CE + alpha * L_con): 0 to ``MAX_LOSS``",
    "final_loss": "mean loss of the last epoch: 0 to ``MAX_LOSS``",
    "epochs": "local epochs",
    "created": "UTC time the file was written, ISO 8601",
    "train_seconds": "wall time of the training: 0 to ``MAX_SECONDS``",
    "classes": "JSON list of the local class names that had images",
    "device": "where it trained (``cpu``, ``cuda``)",
    "images_digest": "sha256 of the images it trained on (each image's class and decoded pixels, in no order): "
                     "two updates over the same images count their examples once (`fedmvp ingest`)",
    "device_id": "the device that trained it: 32 hex digits, drawn at random once and kept in its bundle "
                 "directory (``device-id``); under ``[privacy]`` `fedmvp ingest` takes one update per device per "
                 "release and refuses an update without it (docs/howto/privacy.md)",
    "region_run_id": "a region's update (`fedmvp region-update`, docs/howto/regions.md): the regional run whose "
                     "rounds it sums; ``num_examples`` is then the examples of every device update of those rounds",
    "region_rounds": "a region's update: JSON ``[first, last]``, the regional rounds it sums",
}
REQUIRED = ("format", "format_version", "bundle_id", "bundle_round", "num_examples", "mean_loss", "created")
INT_FIELDS = ("format_version", "bundle_round", "num_examples", "epochs")
FLOAT_FIELDS = ("mean_loss", "final_loss", "train_seconds")
FINITE_FIELDS = ("mean_loss", "final_loss")  # a NaN loss would poison an average
BOUNDS = {"mean_loss": MAX_LOSS, "final_loss": MAX_LOSS, "train_seconds": MAX_SECONDS}  # 0 to these (bounds.py)
DIGEST_FIELDS = ("promptformer_digest", "classes_digest", "base_digest")  # optional within format 1
MAX_HEADER_BYTES = 1 << 20  # names, shapes and metadata (a class list) are KBs
MAX_UPDATE_BYTES = 64 << 20  # without a bundle or a round to size it by
_INTEGER = re.compile(r"0|-?[1-9][0-9]{0,17}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
DEVICE_ID = re.compile(r"[0-9a-f]{32}")  # ``device_id``: 128 random bits, hex


class UpdateFormatError(ValueError):
    """An update file that does not follow the format; one line, without the path (the caller adds it)."""


def utc_now() -> str:
    """UTC now as ISO 8601 with a ``Z`` (the ``created`` stamp)."""
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def integer(text: str | None) -> int | None:
    """A decimal integer exactly as ``str(int)`` writes it (ASCII digits, no sign but ``-``, no spaces,
    no leading zeros, at most 18 digits); anything else is None: one number, one spelling."""
    return int(text) if isinstance(text, str) and _INTEGER.fullmatch(text) else None


# ---- writing ------------------------------------------------------------------------------------
def encode_metadata(metadata: Mapping[str, Any]) -> dict[str, str]:
    """Metadata as strings: None as "", lists/dicts as JSON, floats by ``repr``, the rest by ``str``."""
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


def as_float32(tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """numpy or torch tensors -> contiguous float32 numpy (the format's only dtype), no torch import."""
    out = {}
    for name, value in tensors.items():
        if hasattr(value, "detach"):  # a torch tensor
            value = value.detach().float().cpu().numpy()
        out[name] = np.ascontiguousarray(np.asarray(value, dtype=np.float32))
    return out


def update_bytes(tensors: Mapping[str, Any], metadata: Mapping[str, Any]) -> bytes:
    """The file's bytes; the encoded metadata passes the reader's checks first, so a writer can
    never make a file its readers refuse (``format`` and ``format_version`` are filled in)."""
    from safetensors.numpy import save

    arrays = as_float32(tensors)
    check_names(arrays)
    encoded = encode_metadata({"format": FORMAT, "format_version": FORMAT_VERSION, **metadata})
    check_metadata(encoded)
    return save(arrays, metadata=encoded)


# ---- reading ------------------------------------------------------------------------------------
def size_limit(shapes: Iterable[Sequence[int]]) -> int:
    """The most bytes an update of these LoRA shapes can be: float32 data and a capped header."""
    return 8 + MAX_HEADER_BYTES + sum(4 * math.prod(shape) for shape in shapes)


def read_bounded(path: str | os.PathLike, limit: int, of: str) -> bytes:
    """The file's bytes, refused on its size before any is read (``of``: "round 3", "this bundle": what
    sized ``limit``). Opened without blocking, so a FIFO or a device file is refused, not waited on."""
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise UpdateFormatError("not a regular file")
            data = file.read(limit + 1) if info.st_size <= limit else b""
    except OSError as err:
        raise UpdateFormatError(f"cannot read ({err.strerror or err})") from None
    if info.st_size > limit or len(data) > limit:
        raise UpdateFormatError(f"{max(info.st_size, len(data))} bytes, more than the {limit} an update of {of} "
                                f"can be (its LoRA as float32 and a header of at most {MAX_HEADER_BYTES} bytes)")
    return data


def check_header(data: bytes) -> dict[str, Any]:
    """The header, checked before safetensors parses it: its length within the data and
    ``MAX_HEADER_BYTES``, JSON without a repeated key (two readers could see two files), not nested
    past the recursion limit, ``__metadata__`` str -> str, every tensor F32."""
    def bad(reason: str) -> UpdateFormatError:
        return UpdateFormatError(f"not a safetensors file ({reason})")

    if len(data) < 8:
        raise bad(f"{len(data)} bytes: too short")
    size = int.from_bytes(data[:8], "little")
    if not 0 < size <= min(MAX_HEADER_BYTES, len(data) - 8):
        raise bad(f"header length {size}: more than the {len(data) - 8} bytes that follow it "
                  f"or the {MAX_HEADER_BYTES}-byte cap")
    try:
        header = json.loads(data[8:8 + size], object_pairs_hook=_unique_keys)
    except RecursionError:
        raise bad("header is not valid JSON: nested too deeply") from None
    except ValueError as err:
        raise bad(f"header is not valid JSON: {' '.join(str(err).split())[:120]}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise bad(f"__metadata__ is not an object but {shown(metadata)}")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise UpdateFormatError(f"metadata {name_shown(key)} is not a string ({type(value).__name__})")
    for name, entry in header.items():
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        if name != "__metadata__" and dtype != "F32":
            raise bad(f"tensor {name_shown(name)} has dtype {shown(dtype)}, which is not float32 (F32)")
    return header


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key {shown(next(k for k in keys if keys.count(k) > 1))}")
    return dict(pairs)


def raw_metadata(data: bytes) -> dict[str, str]:
    """The string metadata of an update file's bytes (header checked, values not yet)."""
    return check_header(data).get("__metadata__") or {}


def load_tensors(data: bytes) -> dict[str, np.ndarray]:
    """The tensors, by name; safetensors checks that the data covers every tensor exactly."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    try:
        return load(data)
    except (SafetensorError, ValueError) as err:
        raise UpdateFormatError(f"not a safetensors file, or truncated ({shown(' '.join(str(err).split()), 120)})"
                                ) from None


def check_metadata(raw: Mapping[str, str]) -> dict[str, Any]:
    """The string metadata checked and typed (unknown keys kept as strings): the format and its
    version, the required keys, integers in `integer`'s one spelling, ``num_examples`` positive,
    finite losses within 0 to ``MAX_LOSS`` (seconds within ``MAX_SECONDS``), ``bundle_id`` and the digests
    sha256s, ``created`` ISO 8601, ``classes`` JSON."""
    if raw.get("format") != FORMAT:
        raise UpdateFormatError(f"not a {FORMAT} file (format {shown(raw.get('format'))})")
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise UpdateFormatError(f"metadata lacks {', '.join(missing)}")
    out: dict[str, Any] = dict(raw)
    if integer(raw["format_version"]) != FORMAT_VERSION:
        raise UpdateFormatError(f"update format_version {shown(raw['format_version'])} is not supported "
                                f"(this release reads {FORMAT_VERSION})")
    for key in (k for k in INT_FIELDS if k in raw):
        if key == "bundle_round" and raw[key] in ("", "None"):  # a bundle that records no round
            out[key] = None
            continue
        out[key] = integer(raw[key])
        if out[key] is None:
            what = {"bundle_round": "a round number", "num_examples": "a positive integer"}.get(key, "an integer")
            raise UpdateFormatError(f"{key} {shown(raw[key])} is not {what}")
    if out["num_examples"] <= 0:  # the FedAvg weight: an update with none would weigh nothing
        raise UpdateFormatError(f"num_examples {shown(raw['num_examples'])} is not a positive integer")
    for key in (k for k in FLOAT_FIELDS if k in raw):
        try:
            out[key] = float(raw[key])
        except ValueError:
            out[key] = None
        if out[key] is None or (key in FINITE_FIELDS and not math.isfinite(out[key])):
            raise UpdateFormatError(f"{key} {shown(raw[key])} is not a finite number")
        if key in BOUNDS and not 0 <= out[key] <= BOUNDS[key]:  # NaN fails this too
            raise UpdateFormatError(f"{key} {shown(raw[key])} is not within 0 to {BOUNDS[key]:g}")
    for key in ("bundle_id", *(k for k in DIGEST_FIELDS if k in raw)):
        if not _SHA256.fullmatch(raw[key]):
            raise UpdateFormatError(f"{key} {shown(raw[key], 80)} is not a sha256 hex digest")
    try:
        datetime.fromisoformat(raw["created"])
    except ValueError:
        raise UpdateFormatError(f"created {shown(raw['created'])} is not an ISO 8601 time") from None
    if "images_digest" in raw and not _SHA256.fullmatch(raw["images_digest"]):
        raise UpdateFormatError(f"images_digest {shown(raw['images_digest'], 80)} is not a sha256 hex digest")
    if "device_id" in raw and not DEVICE_ID.fullmatch(raw["device_id"]):
        raise UpdateFormatError(f"device_id {shown(raw['device_id'], 80)} is not 32 hex digits")
    if "classes" in raw:
        try:
            out["classes"] = json.loads(raw["classes"])
        except (ValueError, RecursionError):
            raise UpdateFormatError("classes is not a JSON list") from None
    return out


def check_names(names: Iterable[str]) -> None:
    """Only LoRA tensors (``lora.*``): an update never carries the frozen model or the PromptFormer."""
    stray = sorted(name for name in names if not name.startswith(LORA_PREFIX))
    if stray:
        raise UpdateFormatError(f"holds non-LoRA tensors ({', '.join(name_shown(n) for n in stray[:3])})")


def parse_update(data: bytes, checked: Callable[[dict[str, Any]], None] | None = None
                 ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(tensors, typed metadata) of an update file's bytes, every check above in order; ``checked`` is
    called with the header once it passed, before safetensors parses the data (a caller's own gate)."""
    header = check_header(data)
    if checked is not None:
        checked(header)
    tensors = load_tensors(data)
    metadata = check_metadata(header.get("__metadata__") or {})
    check_names(tensors)
    return dict(sorted(tensors.items())), metadata


def read_update_file(path: str | os.PathLike, limit: int, of: str,
                     checked: Callable[[dict[str, Any]], None] | None = None
                     ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """`read_bounded` then `parse_update`: an update file from disk."""
    return parse_update(read_bounded(Path(path), limit, of), checked)
