"""ONNX Runtime session creation with honest provider selection.

ORT silently falls back to CPU when a requested GPU provider cannot load (missing CUDA
or TensorRT libraries only show up as a log line). On an edge device that turns a 10 ms
inference into a 2 s one without anyone noticing, so a provider asked for by name is
verified after the session exists and a mismatch raises `ProviderError`.
onnxruntime is imported lazily: the package must import on machines without it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

PROVIDER_NAMES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
# `auto` preference order: fastest first.
AUTO_ORDER = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
_CPU = "CPUExecutionProvider"


class ProviderError(RuntimeError):
    """A requested execution provider is unknown, unavailable or failed to load."""


def _ort() -> ModuleType:
    """Import onnxruntime, or say which extra to install."""
    try:
        import onnxruntime
    except ImportError as e:
        raise ImportError(
            f"onnxruntime is not installed ({e}); install fedmvp[cpu] or fedmvp[gpu]"
        ) from e
    return onnxruntime


def available_providers() -> list[str]:
    """Execution providers this onnxruntime build offers (ORT names, its order)."""
    return list(_ort().get_available_providers())


def default_threads() -> int:
    """CPU cores this process may use (honours taskset/cgroup affinity where exposed)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# ORT warns at every session creation that overridable initializers (the bundle's LoRA
# tensors, kept as graph inputs on purpose) are not constant-folded: errors only.
DEFAULT_LOG_SEVERITY = 3


def session_options(threads: int | None = None, log_severity_level: int = DEFAULT_LOG_SEVERITY) -> Any:
    """Full graph optimisation, sequential execution, `threads` intra-op threads, quiet logs."""
    ort = _ort()
    n = default_threads() if threads is None else threads
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.intra_op_num_threads = n
    opts.inter_op_num_threads = 1  # unused in sequential mode; avoid a second pool
    opts.log_severity_level = int(log_severity_level)
    return opts


def _with_initializers(opts: Any, initializers: Mapping[str, np.ndarray] | None) -> tuple[Any, list[Any]]:
    """Override named initializers at session creation (ORT's `add_initializer`).

    The OrtValues must outlive the session: they are returned so the caller keeps them."""
    keep: list[Any] = []
    if not initializers:
        return opts, keep
    ort = _ort()
    for name, value in initializers.items():
        array = np.ascontiguousarray(value)
        ort_value = ort.OrtValue.ortvalue_from_numpy(array)
        keep.extend((array, ort_value))
        opts.add_initializer(name, ort_value)
    return opts, keep


def _provider_chain(provider: str, available: list[str]) -> tuple[list[str], str | None]:
    """Providers to pass to ORT, and the one that must come out on top (None for auto)."""
    key = provider.strip().lower()
    if key == "auto":
        return [p for p in AUTO_ORDER if p in available] or [_CPU], None
    if key not in PROVIDER_NAMES:
        raise ProviderError(
            f"unknown provider {provider!r}; choose one of: auto, {', '.join(PROVIDER_NAMES)}"
        )
    wanted = PROVIDER_NAMES[key]
    if wanted not in available:
        raise ProviderError(
            f"provider {key!r} ({wanted}) is not available in this onnxruntime build "
            f"(available: {', '.join(available) or 'none'})"
            + ("; install fedmvp[gpu] (onnxruntime-gpu) on a CUDA machine" if key != "cpu" else "")
        )
    # GPU providers keep later ones as per-node fallback for operators they lack.
    chain = list(AUTO_ORDER[AUTO_ORDER.index(wanted):])
    return chain, wanted


def make_session(
    model_path: str | os.PathLike[str],
    provider: str = "auto",
    threads: int | None = None,
    initializers: Mapping[str, np.ndarray] | None = None,
) -> tuple[Any, str]:
    """Open `model_path` on `provider` ('auto', 'cpu', 'cuda', 'tensorrt').

    `initializers` ({name: array}) replace the model's initializers of those names for
    this session only (the model file is not touched); the edge client uses it to run a
    personalised LoRA.

    Returns (InferenceSession, provider actually used, ORT name). 'auto' takes the
    first of TensorRT, CUDA, CPU that is available and falls back to CPU if the GPU
    session cannot be built; a named provider that is missing or does not end up as
    the session's primary provider raises `ProviderError`.
    """
    ort = _ort()
    path = Path(model_path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: ONNX model file not found")
    chain, wanted = _provider_chain(provider, list(ort.get_available_providers()))
    opts, keep = _with_initializers(session_options(threads), initializers)
    try:
        sess = ort.InferenceSession(str(path), sess_options=opts, providers=chain)
    except Exception as e:  # noqa: BLE001 - ORT raises several pybind types
        if wanted is not None and wanted != _CPU:
            raise ProviderError(f"provider {provider!r} ({wanted}) failed to load {path}: {_one_line(e)}") from e
        if wanted is None and chain != [_CPU]:
            # auto: a broken GPU stack must not stop inference; retry on CPU.
            opts, keep = _with_initializers(session_options(threads), initializers)
            sess = ort.InferenceSession(str(path), sess_options=opts, providers=[_CPU])
        else:
            raise
    sess._fedmvp_initializers = keep  # keep the overriding OrtValues alive as long as the session
    used = sess.get_providers()[0]
    if wanted is not None and used != wanted:
        raise ProviderError(
            f"provider {provider!r} ({wanted}) failed to load and onnxruntime fell back to "
            f"{used}; check the CUDA/cuDNN/TensorRT libraries"
        )
    return sess, used


def _one_line(e: BaseException) -> str:
    """Exception text squeezed onto one line (ORT messages are multi-line)."""
    text = " ".join(str(e).split())
    return text[:500] + ("..." if len(text) > 500 else "")
