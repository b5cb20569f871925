"""The runtimes a bundle can run on, behind one small interface: ONNX Runtime and OpenVINO.

Why: `edge-client` picks a runtime and a precision per device (docs/architecture.md, "Runtimes");
`Predictor` (``edge_client/infer.py``) and the verification of ``auto`` (``runtime_choice.py``) need
only what every runtime offers: its inputs and outputs by name, the LoRA tensors it takes per run, and
``run(feed)``. A runtime asked for by name that is missing is `RuntimeUnavailable` (exit 2), never a
silent fallback; ``FEDMVP_DISABLED_RUNTIMES=openvino`` (comma-separated names) makes an installed one
unavailable, for a device that must not use it and for the tests. A precision a runtime does not
offer for this bundle on this machine is `ProviderError` too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edge_client.bundle import Bundle
from edge_client.runtime import ProviderError, make_session

RUNTIMES = ("ort", "openvino")
PRECISIONS = ("fp32", "bf16", "fp16", "int8")
DISABLED_ENV = "FEDMVP_DISABLED_RUNTIMES"


class RuntimeUnavailable(ProviderError):
    """A runtime asked for by name is not installed, or is disabled on this device."""


class Engine(Protocol):
    """What a runtime offers the predictor: one model, compiled or opened, run on numpy feeds."""

    runtime: str  # "ort" | "openvino"
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


def disabled(runtime: str) -> bool:
    """Whether ``FEDMVP_DISABLED_RUNTIMES`` names ``runtime``."""
    names = {n.strip().lower() for n in os.environ.get(DISABLED_ENV, "").split(",")}
    return runtime in names


def unavailable(runtime: str) -> str | None:
    """Why ``runtime`` cannot run here (one line), or None when it can."""
    if disabled(runtime):
        return f"{runtime} is disabled on this device ({DISABLED_ENV}={os.environ.get(DISABLED_ENV)})"
    try:
        if runtime == "openvino":
            from edge_client.openvino_runtime import load_openvino

            load_openvino()
        else:
            from edge_client.runtime import available_providers

            available_providers()
    except ImportError as err:
        return str(err)
    return None


def offered(runtime: str, bundle: Bundle) -> list[str]:
    """The precisions ``runtime`` offers for ``bundle`` on this machine (its model file is one precision:
    ONNX Runtime runs it as exported; OpenVINO lowers an fp32 model where the CPU can)."""
    if runtime == "ort":
        return [bundle.precision]
    from edge_client.openvino_runtime import cpu_precisions

    return cpu_precisions(bundle.precision)


def candidates(bundle: Bundle, runtime: str, precision: str) -> tuple[list[Candidate], list[str]]:
    """Every (runtime, precision) the request allows here, and one line per runtime left out and why.
    A runtime or precision named and not offered raises `RuntimeUnavailable` / `ProviderError`."""
    names = RUNTIMES if runtime == "auto" else (runtime,)
    found, notes = [], []
    for name in names:
        why = unavailable(name)
        if why is not None:
            if runtime != "auto":
                raise RuntimeUnavailable(why)
            notes.append(why)
            continue
        precisions = offered(name, bundle)
        if precision != "auto" and precision not in precisions:
            if runtime != "auto":
                raise ProviderError(f"{name} offers {', '.join(precisions)} for this {bundle.precision} bundle on "
                                    f"this machine, not {precision}" + _int8_hint(precision, bundle))
            continue
        found += [Candidate(name, p) for p in precisions if precision in ("auto", p)]
    if not found:
        raise ProviderError(f"no runtime here offers {precision} for this {bundle.precision} bundle"
                            + _int8_hint(precision, bundle) + (f" ({'; '.join(notes)})" if notes else ""))
    return found, notes


def _int8_hint(precision: str, bundle: Bundle) -> str:
    return ("; int8 runs the bundle's int8 model: export one with fedmvp-export --precision int8"
            if precision == "int8" and bundle.precision != "int8" else "")


def open_engine(bundle: Bundle, candidate: Candidate, provider: str = "auto", threads: int | None = None,
                initializers: Mapping[str, np.ndarray] | None = None) -> Engine:
    """``bundle``'s model on ``candidate``; ``initializers``: LoRA tensors in place of the stored ones."""
    path = bundle.file("onnx")
    if candidate.runtime == "openvino":
        from edge_client.openvino_runtime import OpenVinoEngine

        return OpenVinoEngine(path, candidate.precision, bundle.precision, set(bundle.lora_shapes), threads,
                              initializers)
    return OrtEngine(path, candidate.precision, set(bundle.lora_shapes), provider, threads, initializers)


class OrtEngine:
    """An ONNX Runtime session (``edge_client/runtime.py``: the honest-provider rule) as an `Engine`."""

    runtime = "ort"

    def __init__(self, path: Path, precision: str, lora_names: set[str], provider: str = "auto",
                 threads: int | None = None, initializers: Mapping[str, np.ndarray] | None = None) -> None:
        self.session, self.device = make_session(path, provider, threads, initializers=initializers)
        self.precision = precision
        inputs = self.session.get_inputs()
        # LoRA: initializers ORT lets a run feed (export/onnx_export.py keeps them overridable)
        overridable = [*inputs, *self.session.get_overridable_initializers()]
        self.lora_dtypes = {i.name: _dtype(i) for i in overridable if i.name in lora_names}
        self.inputs = {i.name: _dtype(i) for i in inputs if i.name not in lora_names}
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.output_widths = {o.name: o.shape[-1] if o.shape and isinstance(o.shape[-1], int) else None
                              for o in self.session.get_outputs()}

    def run(self, feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        return list(self.session.run(None, dict(feed)))


def _dtype(node: Any) -> type:
    return np.float16 if node.type == "tensor(float16)" else np.float32
