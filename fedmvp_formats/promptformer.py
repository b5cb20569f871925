"""The PromptFormer digest: the identity of a PromptFormer that a server and a device agree on.

Every round message carries the global one (``fedmvp.federated.strategy``), a bundle's manifest
records the one it was exported with (``export.bundle_writer``), and a device whose bundle holds
another refreshes it (``edge_client.refresh``). One definition here, numpy only, so the three can
never disagree.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import numpy as np

from fedmvp_formats.names import PROMPTFORMER_PREFIX


def promptformer_digest(tensors: Mapping[str, np.ndarray]) -> str:
    """sha256 over the ``promptformer.*`` tensors in name order, each as name, NUL, JSON shape, NUL,
    float32 little-endian bytes (other tensors, the LoRA's, do not count)."""
    digest = hashlib.sha256()
    for name in sorted(k for k in tensors if k.startswith(PROMPTFORMER_PREFIX)):
        value = np.ascontiguousarray(tensors[name], dtype="<f4")
        digest.update(name.encode() + b"\0" + json.dumps(list(value.shape)).encode() + b"\0" + value.tobytes())
    return digest.hexdigest()
