"""ExecuTorch as a device runtime: the bundle's ``model.pte`` (`fedmvp-export --format executorch`).

Why: ExecuTorch is the runtime a phone app links (docs/howto/executorch.md); running the same program
here, through ExecuTorch's Python runtime, lets `--runtime auto` verify and time it beside the others and
lets a device check what a phone will compute. Its LoRA tensors are program inputs, fed per run as ONNX
Runtime feeds its overridable initializers, so a personalised or a round's LoRA needs no second program.
It computes in fp32 whatever the ONNX model's precision. One call takes at most ``executorch.max_batch``
images (the program's memory is planned for that), so a larger run is split. It is offered only for a bundle
that carries the program built from the PromptFormer the bundle now holds: a refresh rewrites
weights.safetensors, not this file. executorch (and the torch its Python runtime hands tensors in) is
imported only when an engine opens; availability and version come from the installed package's metadata.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedmvp_formats.bundle_manifest import EXECUTORCH_ROLE

from edge_client.bundle import Bundle
from edge_client.module_io import ModuleIO, ModuleRuntime, engine_section, why_not_offered


def not_offered(bundle: Bundle) -> str | None:
    """Why the executorch runtime cannot run ``bundle`` (one line), or None when it can."""
    return why_not_offered(bundle, EXECUTORCH_ROLE, "ExecuTorch program")


def load_method(path: Path) -> Any:
    """The ``forward`` method of the ExecuTorch program at ``path`` (executorch's Python runtime)."""
    from executorch.runtime import Runtime

    return Runtime.get().load_program(Path(path)).load_method("forward")


def run_batches(method: Any, images: np.ndarray, lora: Sequence[np.ndarray], max_batch: int) -> list[np.ndarray]:
    """Every output of ``method`` on ``images`` [N, 3, H, W], at most ``max_batch`` images per call, concatenated
    (the outputs are copied: the program reuses their memory on the next call)."""
    import torch

    feed = [torch.from_numpy(np.ascontiguousarray(t, dtype=np.float32)) for t in lora]
    parts: list[list[np.ndarray]] = []
    for start in range(0, len(images), max_batch):
        chunk = np.ascontiguousarray(images[start:start + max_batch], dtype=np.float32)
        parts.append([o.numpy().copy() for o in method.execute([torch.from_numpy(chunk), *feed])])
    return [np.concatenate(column) for column in zip(*parts)]


class ExecuTorchEngine:
    """The bundle's ExecuTorch program, its LoRA tensors fed per run (the bundle's unless fed or given)."""

    runtime = "executorch"
    precision = "fp32"

    def __init__(self, bundle: Bundle, threads: int | None = None,
                 initializers: Mapping[str, np.ndarray] | None = None) -> None:
        _, section = engine_section(bundle, EXECUTORCH_ROLE, not_offered(bundle), threads)
        self._method = load_method(bundle.file(EXECUTORCH_ROLE))
        self._max_batch = int(section["max_batch"])
        self.device = "ExecuTorch CPU (XNNPACK)"
        self._io = ModuleIO(bundle, section, initializers)
        self._io.describe(self)

    def run(self, feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Every output, in ``self.outputs`` order; a LoRA tensor absent from ``feed`` is the one given at
        creation (the bundle's by default)."""
        return run_batches(self._method, feed[self._io.image], self._io.lora_feed(feed), self._max_batch)


class ExecuTorchRuntime(ModuleRuntime):
    """ExecuTorch in the table of runtimes: the bundle's program (XNNPACK) on the CPU, fp32 only."""

    label = "ExecuTorch (XNNPACK)"
    version_key = "executorch"
    why_not = staticmethod(not_offered)
    engine = ExecuTorchEngine

    def load(self) -> None:
        for package in ("executorch", "torch"):  # its Python runtime takes and returns torch tensors
            if importlib.util.find_spec(package) is None:
                raise ImportError(f"{package} is not installed; pip install 'fedmvp[executorch]' to use "
                                  f"--runtime executorch")

    def version(self) -> str:
        return importlib.metadata.version("executorch")
