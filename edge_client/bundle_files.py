"""A bundle's names, links and containers, checked as the server (an attacker, if it is one) could shape them.

A bundle comes from the server, and whoever controls the server writes the manifest too, so a sha256
that matches proves only that the file is the one the server meant. Here:

- the manifest lists plain file names only (no directory part, ``..``, backslash or NUL);
- a listed file is a regular file, never a symbolic link: a link to any file the device can read,
  whose sha256 the server put in the manifest, would pass every hash check;
- the directories the device writes into (``personalised/``, ``previous/``) are directories of the
  bundle, not links out of it, and hold no links (a rollback moves what they hold);
- model.onnx reads external data only from files the manifest lists, within their bytes (ONNX
  Runtime refuses paths out of the model's directory; this refuses them, and unlisted files inside,
  before it runs);
- the training program (train.pt2) holds only the entries ``torch.export.save`` writes for a program
  without tensors of its own: ``torch.export.load`` unpickles whatever its weights and constants
  configs name, so both must be empty, no other entry may be there, and every entry is stored or
  deflated within a size cap and a compression ratio read from the zip directory (nothing is inflated
  to check it).

Standard library only. ``BundleError`` lives here because ``edge_client.bundle`` builds on these
checks; import it from there.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fedmvp_formats.bundle_manifest import PERSONALISED, PREVIOUS

from edge_client.protobuf import onnx_external_data


class BundleError(ValueError):
    """A bundle that cannot be used; one line naming the path."""


def fail(path: Path, reason: str) -> BundleError:
    """One-line error naming the path at fault."""
    return BundleError(f"{path}: {reason}")


def plain_name(name: Any) -> bool:
    """Whether ``name`` names a file directly inside a directory, on any system."""
    return isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def _link(path: Path) -> str:
    return f"is a symbolic link (to {os.readlink(path)}); a bundle holds no links, they are not followed"


def file_problem(path: Path) -> str | None:
    """Why ``path`` is not a regular file of its directory; None when it is one."""
    if path.is_symlink():
        return _link(path)
    return None if path.is_file() else "missing from the bundle"


def check_device_dirs(root: Path) -> None:
    """``personalised/`` and ``previous/``, where present, are directories of the bundle holding no links.

    Why: the device writes, renames and deletes there; through a link it would do so outside the bundle."""
    for name in (PERSONALISED, PREVIOUS):
        path = root / name
        if path.is_symlink():
            raise fail(path, _link(path) + "; the device writes there")
        if not path.exists():
            continue
        if not path.is_dir():
            raise fail(path, "not a directory")
        for entry in path.iterdir():
            if entry.is_symlink():
                raise fail(entry, _link(entry))


def check_onnx_external(model: Path, listed: Mapping[str, Any]) -> None:
    """Every tensor model.onnx stores outside itself lies in a file of ``listed`` ({name: bytes}), within it."""
    try:
        tensors = onnx_external_data(model)
    except ValueError as err:
        raise fail(model, f"not a readable ONNX model ({' '.join(str(err).split())[:200]})") from None
    for tensor, entries in tensors:
        where = entries.get("location")
        if not plain_name(where) or where not in listed:
            raise fail(model, f"external data of tensor {tensor!r} is read from {where!r}, not from a file the "
                              f"manifest lists; refusing to load it")
        try:
            offset, length = int(entries.get("offset", 0)), int(entries.get("length", 0))
        except ValueError:
            raise fail(model, f"external data of tensor {tensor!r}: offset or length is not a number") from None
        size = listed[where]
        if offset < 0 or length < 0 or not isinstance(size, int) or offset + length > size:
            raise fail(model, f"external data of tensor {tensor!r}: bytes {offset}..{offset + length} lie outside "
                              f"{where} ({size} bytes)")


# What torch.export.save writes for a program whose tensors are all inputs (export/training_artifact.py),
# below the archive's one directory. Anything else could be unpickled by torch.export.load.
_PROGRAM_ENTRIES = {"data/weights/model_weights_config.json", "data/constants/model_constants_config.json",
                    "models/model.json", "data/sample_inputs/model.pt", "archive_format", "archive_version",
                    ".data/version", "byteorder", ".data/serialization_id"}
_EMPTY_ENTRIES = {"data/sample_inputs/model.pt"}
_EMPTY_CONFIGS = {"data/weights/model_weights_config.json", "data/constants/model_constants_config.json"}
_GRAPH_CAP = 1 << 30  # models/model.json: the graph as JSON (a ViT-B/16 program's is tens of MB)
_ENTRY_CAP = 1 << 20  # every other entry: a few bytes
_MAX_RATIO = 100  # deflated JSON shrinks 5-20x; a thousandfold is a bomb


def verify_program_archive(path: str | os.PathLike) -> None:
    """Refuse a training program that carries anything torch would unpickle or inflate unbounded (call
    before loading it); reads the zip directory and the two configs only, never extracts."""
    def configs(archive: zipfile.ZipFile, infos: list[zipfile.ZipInfo]) -> None:
        for info in infos:
            if info.filename.split("/", 1)[1] in _EMPTY_CONFIGS and not _empty_config(archive.read(info)):
                raise fail(Path(path), f"archive entry {info.filename!r} must be the empty config {{\"config\": {{}}}} "
                                       f"(the program has no tensors of its own; torch would unpickle what it names)")

    check_archive_entries(Path(path), "torch.export", _entry_problem, configs)


EntryRule = Callable[[zipfile.ZipInfo, str, set], "str | None"]  # (entry, the archive's folder, names seen)


def check_archive_entries(path: Path, kind: str, entry_problem: EntryRule,
                          then: Callable[[zipfile.ZipFile, list[zipfile.ZipInfo]], None] | None = None) -> None:
    """Every entry of the zip archive at ``path`` passed through ``entry_problem`` (the first problem is
    one ``BundleError`` line), then ``then(archive, entries)``; a ``kind`` archive that is no zip, or
    cannot be read, is one line too. Reads the directory (and what ``then`` reads), never extracts."""
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
            prefix = infos[0].orig_filename.split("/", 1)[0] if infos else ""
            seen: set[str] = set()
            for info in infos:
                problem = entry_problem(info, prefix, seen)
                if problem:
                    raise fail(path, f"{problem}; refusing to load it")
            if then is not None:
                then(archive, infos)
    except zipfile.BadZipFile:
        raise fail(path, f"not a {kind} archive (bad zip)") from None
    except (OSError, RuntimeError, EOFError) as err:
        raise fail(path, f"not a readable {kind} archive ({' '.join(str(err).split())[:200]})") from None


def _entry_problem(info: zipfile.ZipInfo, prefix: str, seen: set[str]) -> str | None:
    """What is wrong with one zip entry of a training program (None: nothing)."""
    raw = info.orig_filename
    parts = raw.split("/")
    entry = f"archive entry {raw!r}"
    if "\\" in raw or "\0" in raw or any(p in ("", ".", "..") for p in parts) or len(parts) < 2:
        return f"{entry} is not a plain path inside the archive (absolute, '..', backslash or NUL)"
    if parts[0] != prefix:
        return f"{entry} lies outside the archive's directory {prefix!r}"
    name = "/".join(parts[1:])
    if name not in _PROGRAM_ENTRIES:
        return f"unexpected {entry}"
    if raw in seen:
        return f"{entry} appears twice"
    seen.add(raw)
    cap = _GRAPH_CAP if name == "models/model.json" else _ENTRY_CAP
    if info.file_size > cap or info.compress_size > cap:
        return f"{entry} declares {info.file_size} bytes ({info.compress_size} stored), over its cap of {cap}"
    if info.flag_bits & 1:
        return f"{entry} is encrypted"
    if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
        return f"{entry} declares {info.file_size} bytes but stores {info.compress_size} uncompressed"
    if info.compress_type == zipfile.ZIP_DEFLATED and info.file_size > _MAX_RATIO * max(info.compress_size, 1):
        return (f"{entry} would inflate {info.compress_size} bytes to {info.file_size} (more than "
                f"{_MAX_RATIO}x compression: a zip bomb)")
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        return f"{entry} uses compression method {info.compress_type} (only stored and deflated are read)"
    if name in _EMPTY_ENTRIES and info.file_size:
        return f"{entry} must be empty"
    return None


def _empty_config(data: bytes) -> bool:
    """Whether a weights/constants config names nothing (``{"config": {}}``)."""
    try:
        config = json.loads(data)
    except (ValueError, RecursionError):
        return False
    return isinstance(config, dict) and config.get("config") == {}
