"""The bundle's TorchScript training module (``train.torchscript.pt``) behind the training program's interface.

Why: `edge-client train` and `join` train through ``train.pt2`` (``edge_client.program.GraphRunner``), which
only a torch that reads its torch.export archive can load. A trainable bundle exported with
``--format torchscript`` also carries the same computation traced with torch.jit
(``export/torchscript_training.py``); where train.pt2 does not load, training runs through it
(``edge_client.program.load_runner``; docs/howto/torchscript.md). The module is code, so it is checked like
the inference module (``edge_client.torchscript_check``) before torch reads it and before it runs.
TorchScript runs the traced graph whole: no activation checkpointing (one segment), which costs memory on
a constrained GPU, not correctness. Needs torch; imported only when training.
"""

from __future__ import annotations

from typing import Any

from fedmvp_formats.bundle_manifest import TORCHSCRIPT_TRAINING_ROLE

from edge_client.bundle import Bundle, BundleError
from edge_client.torchscript_check import load_checked

_RUNNERS: dict[str, ScriptRunner] = {}


def has_module(bundle: Bundle) -> bool:
    """Whether ``bundle`` carries the TorchScript training module (manifest ``torchscript_training``)."""
    return bundle.manifest.get(TORCHSCRIPT_TRAINING_ROLE) is not None


def load_script_runner(bundle: Bundle) -> ScriptRunner:
    """The bundle's TorchScript training module as a `ScriptRunner` (checked, loaded once per file hash)."""

    if not has_module(bundle):
        raise BundleError(f"{bundle.path}: the bundle carries no TorchScript training module "
                          f"(train.torchscript.pt); export it with fedmvp-export --format torchscript")
    section = bundle.manifest[TORCHSCRIPT_TRAINING_ROLE]
    path = bundle.file(TORCHSCRIPT_TRAINING_ROLE)
    key = bundle.manifest["files"][path.name]["sha256"]  # read_bundle verified it
    if key not in _RUNNERS:
        module = load_checked(path, "training")  # archive and operators checked before it loads / runs
        _RUNNERS.clear()  # one module per process, as for train.pt2
        _RUNNERS[key] = ScriptRunner(module, list(section["lora_inputs"]), list(section.get("weight_inputs") or []))
    return _RUNNERS[key]


class ScriptRunner:
    """``module(pixel_values, view, *lora, *weights)`` called as ``GraphRunner`` is (dicts by name); one
    segment only (TorchScript runs its graph whole, so ``segments`` is ignored and ``plan`` has one piece)."""

    program = "torchscript"

    def __init__(self, module: Any, lora_names: list[str], weight_names: list[str]) -> None:
        self.module = module
        self.lora_names, self.weight_names = lora_names, weight_names

    def flatten(self, pixel_values: Any, view: Any, lora: dict[str, Any], weights: dict[str, Any]) -> list[Any]:
        """The module's positional inputs, in the manifest's order (refuses tensors that do not fit)."""
        if sorted(lora) != sorted(self.lora_names) or sorted(weights) != sorted(self.weight_names):
            raise BundleError("the TorchScript training module's inputs do not match the bundle's LoRA/weights "
                              "tensors")
        return [pixel_values, view, *(lora[n] for n in self.lora_names), *(weights[n] for n in self.weight_names)]

    def max_segments(self) -> int:
        """1: no activation checkpointing through a TorchScript module."""
        return 1

    def plan(self, segments: int) -> list[None]:
        """One piece whatever is asked (the result's ``checkpoint_segments`` then says 1)."""
        return [None]

    def __call__(self, pixel_values: Any, view: Any, lora: dict[str, Any], weights: dict[str, Any],
                 segments: int = 1) -> tuple[Any, Any, Any]:
        """(prompted_features, logits, frozen_features), as ``train.pt2`` gives them."""
        return tuple(self.module(*self.flatten(pixel_values, view, lora, weights)))
