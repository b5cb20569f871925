"""The on-device training program: a ``torch.export`` (.pt2) graph whose only state is its inputs.

``forward(pixel_values, consistency_view, lora, weights)`` returns
``(prompted_features, logits, frozen_features)``: the normalised prompted feature and the
logits of ``pixel_values`` (LoRA applied) and the normalised unprompted CLIP feature of
``consistency_view`` (an augmented view, for L_con). ``lora`` and ``weights`` are dicts of
tensors by name with keys in sorted order (the exported input spec is order-sensitive): the
LoRA tensors (what the device trains) and every frozen tensor, read from the bundle's
``weights.safetensors`` (the file the fp32 ONNX model also points into), so the frozen
weights are stored once. The program holds no parameters, buffers or tensor constants, so
nothing but the tensors the caller marks ``requires_grad`` can be trained.

Loading: ``torch.export.load(path).module()``. The graph is JSON, but torch.load runs on
some archive entries (weights_only first, then a full unpickle as fallback). Our archives
leave those entries empty; ``edge_client.bundle.verify_program_archive`` refuses any other,
and the bundle reader checks the file's sha256 against the manifest before anything loads it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call

from export.edge_module import EdgeClassifier
from export.onnx_export import no_mha_fastpath

OUTPUT_NAMES = ("prompted_features", "logits", "frozen_features")
INPUT_NAMES = ("pixel_values", "consistency_view", "lora", "weights")


class _TrainingView(nn.Module):
    """The three training outputs of an EdgeClassifier."""

    def __init__(self, edge: EdgeClassifier):
        super().__init__()
        self.edge = edge

    def forward(self, pixel_values: torch.Tensor, view: torch.Tensor):
        features = self.edge.encode(pixel_values)
        return features, self.edge.logits(features), self.edge.encode_frozen(view)


class TrainingProgram(nn.Module):
    """Stateless wrapper: every tensor of the EdgeClassifier comes in as an input."""

    def __init__(self, edge: EdgeClassifier):
        super().__init__()
        self._view = [_TrainingView(edge)]  # a list, so export does not lift its tensors as state

    def forward(self, pixel_values: torch.Tensor, consistency_view: torch.Tensor,
                lora: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]):
        tensors = {f"edge.{k}": v for k, v in {**weights, **lora}.items()}
        return functional_call(self._view[0], tensors, (pixel_values, consistency_view), strict=True)


def export_program(edge: EdgeClassifier, image_size: int, batch: int = 2) -> torch.export.ExportedProgram:
    """torch.export the training program with a dynamic batch (traced at batch >= 2)."""
    program = TrainingProgram(edge)
    lora = {k: v.detach().clone() for k, v in sorted(edge.lora_tensors().items())}
    weights = {k: v.detach().clone() for k, v in sorted(edge.frozen_tensors().items())}
    example = torch.zeros(batch, 3, image_size, image_size)
    dim = torch.export.Dim("batch", min=1, max=1 << 16)
    shapes = ({0: dim}, {0: dim}, {k: None for k in lora}, {k: None for k in weights})
    with no_mha_fastpath():
        exported = torch.export.export(program, (example, example.clone(), lora, weights),
                                       dynamic_shapes=shapes, strict=False)
    state = {**exported.state_dict, **exported.constants}
    if state:
        raise RuntimeError(f"training program captured tensors as state: {', '.join(sorted(state)[:5])}")
    return exported


def save_program(exported: torch.export.ExportedProgram, path: Path) -> None:
    """Save without example inputs: they would store every weight again, pickled."""
    exported.example_inputs = None
    torch.export.save(exported, str(path))
