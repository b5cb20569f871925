"""The device's id: 128 random bits its bundle directory keeps, which every update file it writes carries.

Why: a server that releases a round under ``[privacy]`` must charge a device once however many update
files it sent (`fedmvp ingest` takes one per device per release: docs/howto/privacy.md). The id protects
the device's own data, so the device is trusted to say it: a device that lies only spends its own privacy.
It is drawn once (``secrets``) and kept in ``<bundle>/device-id`` once an update it names is written
(`keep_device_id`: a training that fails leaves the bundle as it was), which a refresh leaves in place; a
bundle directory is one device (copy a bundle to another device without it).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from fedmvp_formats.bundle_manifest import DEVICE_ID_FILE
from fedmvp_formats.update import DEVICE_ID


class DeviceIdError(ValueError):
    """The bundle's ``device-id`` file is not one this client wrote; one line naming it."""


_DRAWN: dict[Path, str] = {}  # ids drawn in this process and not kept yet, by bundle directory


def device_id(bundle_dir: str | os.PathLike) -> str:
    """The id kept in ``bundle_dir/device-id``; where none is kept yet, one drawn for this process (the same
    on every call) that `keep_device_id` writes once an update naming it is written."""
    path = Path(bundle_dir) / DEVICE_ID_FILE
    if not path.exists() and not path.is_symlink():
        return _DRAWN.setdefault(path.resolve(), secrets.token_hex(16))
    if path.is_symlink() or not path.is_file():
        raise DeviceIdError(f"{path}: not a regular file (the device's id is kept there)")
    text = path.read_bytes()[:64].decode("ascii", "replace").strip()
    if not DEVICE_ID.fullmatch(text):
        raise DeviceIdError(f"{path}: not a device id (32 hex digits); delete it to draw a new one")
    return text


def keep_device_id(bundle_dir: str | os.PathLike) -> None:
    """Write the id this process drew for ``bundle_dir`` (nothing where one is kept already): exclusively and
    atomically, so of two writers the first one's id stays."""
    path = Path(bundle_dir) / DEVICE_ID_FILE
    drawn = _DRAWN.pop(path.resolve(), None)
    if drawn is None or path.exists() or path.is_symlink():
        return
    temp = path.with_name(f".{DEVICE_ID_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    temp.write_text(drawn + "\n")
    try:
        os.link(temp, path)  # fails if another process created it meanwhile: theirs is the id
    except FileExistsError:
        pass
    finally:
        temp.unlink(missing_ok=True)
