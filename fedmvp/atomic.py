"""The training core's atomic writes: ``fedmvp_formats.atomic`` plus the one that needs torch.

A crash, Ctrl-C or full disk never leaves half a file behind: readers see the old file or the
new one. Used for run directories (config, checkpoints, metrics, plot), attribute files, the
text-feature cache and the synthetic world's metadata. ``atomic_dir`` does the same for a folder
of files (a checkpoint round: its tensors and its state.json appear together or not at all).
The writers themselves live in the shared leaf (``fedmvp_formats``), where the device's and the
exporter's writes come from too; this module adds only ``save_safetensors`` of torch tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedmvp_formats.atomic import atomic_dir, atomic_path, write_bytes, write_json, write_text
from fedmvp_formats.files import os_error_line, probe_writable

__all__ = ["atomic_dir", "atomic_path", "os_error_line", "probe_writable", "save_safetensors", "write_bytes",
           "write_json", "write_text"]


def save_safetensors(tensors: dict[str, Any], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """torch tensors to a safetensors file, written atomically."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:  # the library writes the file itself: not held in memory twice
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata=metadata)
