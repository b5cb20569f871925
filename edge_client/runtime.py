"""ONNX Runtime session creation with honest provider selection.

ORT silently falls back to CPU when a requested GPU provider cannot load (missing CUDA
or TensorRT libraries only show up as a log line). On an edge device that turns a 10 ms
inference into a 2 s one without anyone noticing, so a provider asked for by name is
verified after the session exists and a mismatch raises `ProviderError`.
onnxruntime is imported lazily: the package must import on machines without it.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Any

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


def session_options(threads: int | None = None) -> Any:
    """Full graph optimisation, sequential execution, `threads` intra-op threads."""
    ort = _ort()
    n = default_threads() if threads is None else threads
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.intra_op_num_threads = n
    opts.inter_op_num_threads = 1  # unused in sequential mode; avoid a second pool
    return opts


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
) -> tuple[Any, str]:
    """Open `model_path` on `provider` ('auto', 'cpu', 'cuda', 'tensorrt').

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
    opts = session_options(threads)
    try:
        sess = ort.InferenceSession(str(path), sess_options=opts, providers=chain)
    except Exception as e:  # noqa: BLE001 - ORT raises several pybind types
        if wanted is not None and wanted != _CPU:
            raise ProviderError(f"provider {provider!r} ({wanted}) failed to load {path}: {_one_line(e)}") from e
        if wanted is None and chain != [_CPU]:
            # auto: a broken GPU stack must not stop inference; retry on CPU.
            sess = ort.InferenceSession(str(path), sess_options=session_options(threads), providers=[_CPU])
        else:
            raise
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
