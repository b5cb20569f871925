"""The runtimes a bundle can run on, in one table: ONNX Runtime and OpenVINO (and any registered).

Why: `edge-client` picks a runtime and a precision per device (docs/architecture.md, "Runtimes");
`Predictor` (``edge_client/infer.py``) and the verification of ``auto`` (``runtime_choice.py``) need
only what every runtime offers (``edge_client/engine_types.py``): its inputs and outputs by name, the LoRA
tensors it takes per run, and ``run(feed)``. Each runtime is a `RuntimeFactory` in the table below, named
by ``--runtime`` (whose choices are the table's, plus ``auto``, which weighs them all); a new one is its
module and one line here, or ``register_runtime`` from outside the package. A runtime asked for by name
that is missing is `RuntimeUnavailable` (exit 2), never a silent fallback; ``disable_runtimes`` makes an
installed one unavailable, for a device that must not use it and for the tests (the device commands pass
``$FEDMVP_DISABLED_RUNTIMES``: ``fedmvp_apps/edge_runtimes.py``; the library reads no environment). A precision a runtime does not offer for this bundle on this machine is `ProviderError` too.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.bundle import Bundle
from edge_client.engine_types import Candidate, Engine, RuntimeFactory
from edge_client.executorch_runtime import ExecuTorchRuntime
from edge_client.openvino_runtime import OpenVinoRuntime
from edge_client.requirements import runtime_blocker
from edge_client.runtime import ProviderError, make_session
from edge_client.torchscript_runtime import TorchScriptRuntime

__all__ = ["Candidate", "DEFAULT_RUNTIME", "Engine", "OrtEngine", "PRECISIONS", "RuntimeFactory",
           "RuntimeUnavailable", "candidates", "disable_runtimes", "disabled", "factory", "offered", "open_engine", "register_runtime",
           "runtime_names", "unavailable", "unregister_runtime"]

PRECISIONS = ("fp32", "bf16", "fp16", "int8")
DEFAULT_RUNTIME = "ort"  # the bundle as exported: auto's reference and its fallback


class RuntimeUnavailable(ProviderError):
    """A runtime asked for by name is not installed, or is disabled on this device."""


class OrtRuntime:
    """ONNX Runtime: the model as exported (its one precision), on the provider ``--provider`` names."""

    label = "ONNX Runtime"
    version_key = "onnxruntime"

    def load(self) -> None:
        from edge_client.runtime import available_providers

        available_providers()

    def version(self) -> str:
        import onnxruntime

        return str(onnxruntime.__version__)

    def offered(self, bundle: Bundle) -> list[str]:
        return [bundle.precision]

    def open(self, bundle: Bundle, candidate: Candidate, provider: str, threads: int | None,
             initializers: Mapping[str, np.ndarray] | None) -> Engine:
        return OrtEngine(bundle.file("onnx"), candidate.precision, set(bundle.lora_shapes), provider, threads,
                         initializers)


_RUNTIMES: dict[str, RuntimeFactory] = {
    "ort": OrtRuntime(),
    "openvino": OpenVinoRuntime(),
    "torchscript": TorchScriptRuntime(),
    "executorch": ExecuTorchRuntime(),
}


def register_runtime(name: str, runtime: RuntimeFactory, replace: bool = False) -> None:
    """Make ``runtime`` the one ``--runtime name`` opens, and a candidate of ``--runtime auto``; a taken
    name (or ``auto``) needs ``replace``."""
    if not name or name != name.strip().lower() or name == "auto":
        raise ValueError(f"a runtime name must be a lower-case word other than auto, got {name!r}")
    if name in _RUNTIMES and not replace:
        raise ValueError(f"runtime {name!r} is registered already (replace=True to replace it)")
    _RUNTIMES[name] = runtime


def unregister_runtime(name: str) -> None:
    """Remove a runtime ``register_runtime`` added (a test's, when it ends)."""
    if name != DEFAULT_RUNTIME:
        _RUNTIMES.pop(name, None)


def runtime_names() -> tuple[str, ...]:
    """The registered runtimes, in registration order (``--runtime``'s choices, with auto)."""
    return tuple(_RUNTIMES)


def factory(runtime: str) -> RuntimeFactory:
    """The registered runtime ``runtime``; an unknown name is `RuntimeUnavailable` naming the registered."""
    found = _RUNTIMES.get(runtime)
    if found is None:
        raise RuntimeUnavailable(f"unknown runtime {runtime!r} (one of auto, {', '.join(_RUNTIMES)})")
    return found


_DISABLED: dict[str, str] = {}  # runtime name -> who switched it off on this device (said in its error line)


def disable_runtimes(names: str, why: str) -> None:
    """Switch off the runtimes ``names`` lists (comma-separated; "" switches none off) for this process,
    replacing what was switched off before; ``why`` is what the error line names as the cause."""
    _DISABLED.clear()
    _DISABLED.update({n.strip().lower(): why for n in names.split(",") if n.strip()})


def disabled(runtime: str) -> bool:
    """Whether ``disable_runtimes`` switched ``runtime`` off."""
    return runtime in _DISABLED


def unavailable(runtime: str) -> str | None:
    """Why ``runtime`` cannot run here (one line), or None when it can."""
    if disabled(runtime):
        return f"{runtime} is disabled on this device ({_DISABLED[runtime]})"
    try:
        factory(runtime).load()
    except ImportError as err:
        return str(err)
    return None


def offered(runtime: str, bundle: Bundle) -> list[str]:
    """The precisions ``runtime`` offers for ``bundle`` on this machine (its model file is one precision:
    ONNX Runtime runs it as exported; OpenVINO lowers an fp32 model where the CPU can)."""
    return factory(runtime).offered(bundle)


def candidates(bundle: Bundle, runtime: str, precision: str) -> tuple[list[Candidate], list[str]]:
    """Every (runtime, precision) the request allows here, and one line per runtime left out and why.
    A runtime or precision named and not offered raises `RuntimeUnavailable` / `ProviderError`."""
    names = runtime_names() if runtime == "auto" else (runtime,)
    found, notes = [], []
    for name in names:
        why = unavailable(name) or runtime_blocker(bundle, name, factory(name))  # too old: docs/howto/jetson.md
        if why is not None:
            if runtime != "auto":
                raise RuntimeUnavailable(why)
            notes.append(why)
            continue
        precisions = offered(name, bundle)
        if not precisions and runtime != "auto":  # e.g. the bundle lacks the runtime's model; its own line
            why_not = getattr(factory(name), "not_offered", None)
            raise RuntimeUnavailable((why_not(bundle) if why_not else None) or f"{name} offers nothing for this bundle")
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
    return factory(candidate.runtime).open(bundle, candidate, provider, threads, initializers)


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
