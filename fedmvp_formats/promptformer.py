"""The PromptFormer digest and the base digest: the identity of a global state that a server and a
device agree on.

Every round message carries the global PromptFormer's digest (``fedmvp.federated.strategy``), a
bundle's manifest records the one it was exported with (``export.bundle_writer``), and a device whose
bundle holds another refreshes it (``edge_client.refresh``). The *base digest* adds the global LoRA:
the exact state an update was trained from and is a delta against. An ingest round keeps the
PromptFormer and moves only the LoRA, so the PromptFormer alone cannot tell round R's state from round
R+1's; the base digest can, and `fedmvp ingest` takes an update's staleness from the round whose state
it names, never from the round number written beside it (docs/security.md). One definition here,
numpy only, so the server, the exporter and the device can never disagree.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import numpy as np

from fedmvp_formats.names import LORA_PREFIX, PROMPTFORMER_PREFIX

BASE_DIGEST_TAG = b"fedmvp-base-1\0"  # the definition's version: a changed definition is another tag


def tensors_digest(tensors: Mapping[str, np.ndarray], prefix: str) -> str:
    """sha256 over the tensors whose names start with ``prefix``, in name order, each as name, NUL, JSON
    shape, NUL, float32 little-endian bytes (other tensors do not count)."""
    digest = hashlib.sha256()
    for name in sorted(k for k in tensors if k.startswith(prefix)):
        value = np.ascontiguousarray(tensors[name], dtype="<f4")
        digest.update(name.encode() + b"\0" + json.dumps(list(value.shape)).encode() + b"\0" + value.tobytes())
    return digest.hexdigest()


def promptformer_digest(tensors: Mapping[str, np.ndarray]) -> str:
    """`tensors_digest` of the ``promptformer.*`` tensors (the LoRA's do not count)."""
    return tensors_digest(tensors, PROMPTFORMER_PREFIX)


def base_digest(promptformer: str, lora: Mapping[str, np.ndarray]) -> str:
    """The global state an update starts from: sha256 of the tag, the PromptFormer's digest and the
    ``lora.*`` tensors' `tensors_digest`. Built from the PromptFormer's digest, not its tensors, so a
    device that holds only the digest (its bundle's manifest, a round's message) computes it too."""
    lora_part = tensors_digest(lora, LORA_PREFIX)
    return hashlib.sha256(BASE_DIGEST_TAG + promptformer.encode() + b"\0" + lora_part.encode()).hexdigest()


def state_base_digest(tensors: Mapping[str, np.ndarray]) -> str:
    """`base_digest` of a whole state (a round's checkpoint, as numpy): its PromptFormer and its LoRA."""
    return base_digest(promptformer_digest(tensors), tensors)
