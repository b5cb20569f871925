"""TorchScript as a device runtime: the bundle's ``model.torchscript.pt`` (`fedmvp-export --format torchscript`).

Why: a device with PyTorch can run the inference module the ONNX model was exported from, traced with
torch.jit (``export/torchscript_export.py``); `--runtime auto` verifies and times it beside the others.
Its LoRA tensors are module inputs, fed per run as ONNX Runtime feeds its overridable initializers, so
a personalised or a round's LoRA needs no second model. It computes in fp32 whatever the ONNX model's
precision. It is offered only for a bundle that carries the artifact (manifest ``torchscript``) built
from the PromptFormer the bundle now holds: a refresh rewrites weights.safetensors, not this file.
torch is imported only when an engine opens (`edge-client infer` on another runtime stays torch-free);
availability and version are read from the installed package's metadata.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Mapping

import numpy as np

from fedmvp_formats.bundle_manifest import TORCHSCRIPT_ROLE

from edge_client.bundle import Bundle
from edge_client.module_io import ModuleIO, ModuleRuntime, engine_section, why_not_offered
from edge_client.torchscript_check import load_checked


def not_offered(bundle: Bundle) -> str | None:
    """Why the torchscript runtime cannot run ``bundle`` (one line), or None when it can."""
    return why_not_offered(bundle, TORCHSCRIPT_ROLE, "TorchScript module")


class TorchScriptEngine:
    """The bundle's TorchScript module, its LoRA tensors fed per run (the bundle's unless fed or given)."""

    runtime = "torchscript"
    precision = "fp32"

    def __init__(self, bundle: Bundle, threads: int | None = None,
                 initializers: Mapping[str, np.ndarray] | None = None) -> None:
        torch, section = engine_section(bundle, TORCHSCRIPT_ROLE, not_offered(bundle), threads)
        self._module = load_checked(bundle.file(TORCHSCRIPT_ROLE)).eval()  # archive and operators checked
        self._torch = torch
        self.device = "TorchScript CPU"
        self._io = ModuleIO(bundle, section, initializers)
        self._io.describe(self)

    def run(self, feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Every output, in ``self.outputs`` order; a LoRA tensor absent from ``feed`` is the one given at
        creation (the bundle's by default)."""
        torch = self._torch
        lora = [torch.from_numpy(t) for t in self._io.lora_feed(feed)]
        with torch.inference_mode():
            outs = self._module(torch.from_numpy(np.ascontiguousarray(feed[self._io.image], dtype=np.float32)), *lora)
        return [o.numpy() for o in outs]


class TorchScriptRuntime(ModuleRuntime):
    """TorchScript in the table of runtimes: the bundle's traced module on the CPU, fp32 only."""

    label = "TorchScript (torch)"
    version_key = "torch"
    why_not = staticmethod(not_offered)
    engine = TorchScriptEngine

    def load(self) -> None:
        if importlib.util.find_spec("torch") is None:
            raise ImportError("torch is not installed; install torch to use --runtime torchscript")

    def version(self) -> str:
        return importlib.metadata.version("torch")
