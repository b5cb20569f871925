"""The inputs, outputs and LoRA of a bundle's traced-module engines (TorchScript, ExecuTorch).

Why one place: both artifacts are the same inference module with its LoRA tensors as inputs, and their
manifest sections list the same things (``inputs``: the image input, then ``lora_inputs``; ``outputs``),
so `edge_client.torchscript_runtime` and `edge_client.executorch_runtime` present them to `Predictor`
alike: what `edge_client.engine_types.Engine` asks for, and the LoRA fed per run (the one given at
creation, the bundle's by default, unless the run feeds another).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from edge_client.bundle import Bundle


class ModuleIO:
    """An artifact's engine attributes from its manifest ``section``, and its per-run LoRA feed."""

    def __init__(self, bundle: Bundle, section: Mapping[str, Any],
                 initializers: Mapping[str, np.ndarray] | None = None) -> None:
        self.lora_order = list(section["lora_inputs"])
        self.image = section["inputs"][0]
        self.inputs: dict[str, type] = {self.image: np.float32}
        self.lora_dtypes: dict[str, type] = {name: np.float32 for name in self.lora_order}
        self.outputs: list[str] = list(section["outputs"])
        classes = len(bundle.class_names)
        self.output_widths: dict[str, int | None] = {n: classes if n in ("logits", "probs") else None
                                                     for n in self.outputs}
        given = {**bundle.lora(), **(initializers or {})}
        self.lora = {name: np.ascontiguousarray(given[name], dtype=np.float32) for name in self.lora_order}

    def describe(self, engine: Any) -> None:
        """Give ``engine`` the attributes an `Engine` has (inputs, lora_dtypes, outputs, output_widths)."""
        engine.inputs, engine.lora_dtypes = self.inputs, self.lora_dtypes
        engine.outputs, engine.output_widths = self.outputs, self.output_widths

    def lora_feed(self, feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """The LoRA tensors of one run in the artifact's input order: ``feed``'s, else the ones given."""
        return [np.ascontiguousarray(feed.get(n, self.lora[n]), dtype=np.float32) for n in self.lora_order]
