"""What a bundle's traced-module runtimes (TorchScript, ExecuTorch) share: when they are offered, their
factory side, and their engines' inputs, outputs and LoRA.

Why one place: both artifacts are the same inference module with its LoRA tensors as inputs, and their
manifest sections list the same things (``inputs``: the image input, then ``lora_inputs``; ``outputs``),
so `edge_client.torchscript_runtime` and `edge_client.executorch_runtime` present them to `Predictor`
alike: what `edge_client.engine_types.Engine` asks for, and the LoRA fed per run (the one given at
creation, the bundle's by default, unless the run feeds another).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from edge_client.bundle import Bundle


def why_not_offered(bundle: Bundle, role: str, what: str) -> str | None:
    """Why the bundle's ``what`` (manifest section ``role``) cannot run (one line), or None when it can: absent,
    or built from another PromptFormer than the bundle now holds (a refresh rewrites weights.safetensors,
    not the artifact)."""
    section = bundle.manifest.get(role)
    if section is None:
        return f"{bundle.path}: the bundle carries no {what}; export it with fedmvp-export --format {role}"
    baked = section.get("promptformer_digest")
    if baked is not None and baked != bundle.promptformer_digest:
        return (f"{bundle.path}: its {what} holds another PromptFormer than the refreshed bundle; "
                f"re-export the round with --format {role}")
    return None


class ModuleRuntime:
    """The factory side both share (`edge_client.engine_types.RuntimeFactory`): fp32 only, offered for a
    bundle where ``why_not`` finds nothing against it, opened as ``engine``."""

    why_not: Callable[[Bundle], str | None]  # one line: why the bundle cannot run here (None: it can)
    engine: Callable[..., Any]  # (bundle, threads, initializers) -> the opened engine

    def offered(self, bundle: Bundle) -> list[str]:
        return [] if self.why_not(bundle) else ["fp32"]

    def not_offered(self, bundle: Bundle) -> str | None:
        """The one line `--runtime NAME` fails with for a bundle it is not offered for."""
        return self.why_not(bundle)

    def open(self, bundle: Bundle, candidate: Any, provider: str, threads: int | None,
             initializers: Mapping[str, np.ndarray] | None) -> Any:
        return self.engine(bundle, threads, initializers)


def engine_section(bundle: Bundle, role: str, why: str | None, threads: int | None) -> tuple[Any, Mapping[str, Any]]:
    """torch, imported now with its intra-op threads set, and the artifact's manifest section (``role``);
    ValueError ``why`` when the artifact cannot run."""
    import torch

    from edge_client.runtime import default_threads

    if why is not None:
        raise ValueError(why)
    torch.set_num_threads(int(default_threads() if threads is None else threads))
    return torch, bundle.manifest[role]


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
