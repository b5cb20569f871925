"""Atomic file writes (temp file in the same folder + rename): a crash never leaves half a file."""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp path beside ``path``; on success it replaces ``path``, on error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; the result should look like any written file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | Path, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path,
                     metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata=metadata)
