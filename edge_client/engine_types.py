"""What a runtime is to the device: an `Engine` (one model, run on numpy feeds) and the `RuntimeFactory`
that reports whether it is installed, its version and precisions, and opens engines.

Why a module of its own: the table of runtimes (``edge_client/engines.py``) and each runtime's module
(``openvino_runtime.py``, or one registered from outside the package with ``register_runtime``) both
need these names, and the table imports the runtimes. numpy and the standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class Engine(Protocol):
    """What a runtime offers the predictor: one model, compiled or opened, run on numpy feeds."""

    runtime: str  # the name it is registered under ("ort", "openvino", ...)
    precision: str  # what the model computes in: fp32 | bf16 | fp16 | int8
    device: str  # where: ONNX Runtime's provider, or "OpenVINO CPU"
    inputs: dict[str, type]  # image inputs and their numpy dtype
    lora_dtypes: dict[str, type]  # the LoRA tensors it takes per run
    outputs: list[str]
    output_widths: dict[str, int | None]

    def run(self, feed: Mapping[str, np.ndarray]) -> list[np.ndarray]: ...


@dataclass(frozen=True)
class Candidate:
    """One runtime at one precision, as ``auto`` weighs it and the cache names it."""

    runtime: str
    precision: str

    @property
    def key(self) -> str:
        return f"{self.runtime}:{self.precision}"

    def describe(self) -> str:
        return f"{self.runtime} {self.precision}"


class RuntimeFactory(Protocol):
    """One runtime as the table holds it (``engines.register_runtime``). ``bundle`` is an
    ``edge_client.bundle.Bundle``: its ``file("onnx")``, ``precision`` and ``lora_shapes``."""

    label: str  # how --runtime's help names it: "ONNX Runtime", "fedmvp[openvino]"
    version_key: str  # its key in the machine record a cached verdict holds for ("onnxruntime")

    def load(self) -> None:
        """Import what it needs; ImportError (one line: what to install) when it is not installed."""

    def version(self) -> str:
        """Its version string (it is installed)."""

    def offered(self, bundle: Any) -> list[str]:
        """The precisions it offers for ``bundle`` on this machine."""

    def open(self, bundle: Any, candidate: Candidate, provider: str, threads: int | None,
             initializers: Mapping[str, np.ndarray] | None) -> Engine:
        """``bundle``'s model at ``candidate.precision`` (``provider``: ONNX Runtime's, which others may
        ignore; ``initializers``: LoRA tensors in place of the stored ones)."""
