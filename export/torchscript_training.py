"""The TorchScript training module, ``train.torchscript.pt``: what ``train.pt2`` computes, for a torch that cannot load it.

Why: ``train.pt2`` (``export/training_artifact.py``) is a torch.export archive, and an older or newer torch
on a device may refuse it (``edge_client.program.load_program``); TorchScript archives load across far more
torch versions and in C++ (libtorch). With ``fedmvp-export --format torchscript`` a trainable bundle also
carries this module, and `edge-client train`/`join` fall back to it (docs/howto/torchscript.md).

``forward(pixel_values, consistency_view, *lora, *weights)`` returns
``(prompted_features, logits, frozen_features)`` exactly as the training program does. Every tensor comes in
as a positional input (varargs, so Python and C++ call it with a flat list): the LoRA tensors, then every
frozen tensor of ``weights.safetensors``, each group in sorted name order (the manifest's
``torchscript_training.inputs``). The archive holds no weights (the frozen ones stay stored once), and only
what the caller marks ``requires_grad`` trains: the LoRA. A plain ``torch.jit.load`` runs forward and backward.
Traced through the same ``plain_attention`` as the inference module (same math as ``nn.MultiheadAttention``,
held to it by the parity check below against the eager module, gradients included).
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fedmvp_formats.bundle_manifest import ROLES, TORCHSCRIPT_FORMAT, TORCHSCRIPT_TRAINING_FILE
from fedmvp_formats.objective import fedmvp_objective
from fedmvp_formats.parity_rules import FP32_MAX_ABS_DIFF

from export.edge_module import EdgeClassifier, no_mha_fastpath
from export.onnx_export import plain_attention
from export.torchscript_export import portable_archive, quiet_torchscript, tensors_as_inputs
from export.training_artifact import INPUT_NAMES, OUTPUT_NAMES

# The LoRA gradients of the module against the eager module's: max |diff| over max |eager gradient|, per
# tensor. fp32 summation order differs between the two graphs; 1e-3 is far above that and far below a bug.
GRAD_MAX_REL_DIFF = 1e-3
PARITY_BATCH = 8  # images the gradient check runs on (the outputs: the same images)


class _TensorInputs(nn.Module):
    """``edge``'s training outputs with every tensor (LoRA, then weights) a positional input."""

    def __init__(self, edge: EdgeClassifier, names: list[str]) -> None:
        super().__init__()
        self._edge = [edge]  # a list: the trace must not keep the edge's tensors as the module's own
        self.names = names

    def forward(self, pixel_values: torch.Tensor, consistency_view: torch.Tensor,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        edge = self._edge[0]
        with tensors_as_inputs(edge, dict(zip(self.names, tensors))):
            features = edge.encode(pixel_values)
            return features, edge.logits(features), edge.encode_frozen(consistency_view)


def input_names(edge: EdgeClassifier) -> tuple[list[str], list[str]]:
    """(LoRA names, frozen weight names), each sorted: the order the module takes them after the two images."""
    return sorted(edge.lora_tensors()), sorted(edge.frozen_tensors())


def export_training_module(edge: EdgeClassifier, image_size: int, path: Path, batch: int = 2) -> None:
    """Trace the training outputs of ``edge`` (batch ``batch``; the batch dimension stays free), check it
    captured no tensor, and save it to ``path`` (fixed serialization id: the same bytes every export)."""
    lora, weights = input_names(edge)
    named = {**edge.lora_tensors(), **edge.frozen_tensors()}
    tensors = tuple(named[n].detach().clone() for n in (*lora, *weights))
    example = torch.zeros(batch, 3, image_size, image_size)
    wrapper = _TensorInputs(edge, [*lora, *weights]).eval()
    with quiet_torchscript(), no_mha_fastpath(), plain_attention(edge):
        traced = torch.jit.trace(wrapper, (example, example.clone(), *tensors), check_trace=False,
                                 _store_inputs=False)  # the example inputs would store every weight again
        constants = [n.output().toIValue() for n in traced.inlined_graph.nodes() if n.kind() == "prim::Constant"]
        captured = [c for c in constants if isinstance(c, torch.Tensor) and c.numel() > 1]
        if captured or list(traced.parameters()) or list(traced.buffers()):
            raise RuntimeError(f"the TorchScript training module captured tensors ({len(captured)} constants); "
                               f"every tensor must be an input")
        buffer = io.BytesIO()
        torch.jit.save(traced, buffer)
    Path(path).write_bytes(portable_archive(buffer.getvalue()))


@dataclass(frozen=True)
class TrainingParity:
    """The module against the eager EdgeClassifier: outputs and the LoRA gradients of the FedMVP loss."""

    images: int
    max_abs_output_diff: float  # over prompted features, logits and frozen features
    max_rel_grad_diff: float  # per LoRA tensor: max |diff| / max |eager gradient|, the worst
    passed: bool

    def to_manifest(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        verdict = "ok" if self.passed else "FAILED"
        return (f"torchscript training parity: {self.images} images, max |output diff| "
                f"{self.max_abs_output_diff:.2e} (need <= {FP32_MAX_ABS_DIFF:g}), max relative LoRA gradient "
                f"diff {self.max_rel_grad_diff:.2e} (need <= {GRAD_MAX_REL_DIFF:g}): {verdict}")


def _outputs_and_grads(run, lora: dict[str, torch.Tensor], images: torch.Tensor, labels: torch.Tensor):
    """``run(lora)``'s three outputs (detached) and the LoRA gradients of the FedMVP loss (alpha 1)."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in lora.items()}
    outs = run(leaves)
    loss = fedmvp_objective(outs[0], outs[1], outs[2], labels, 1.0, F)["loss"]
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return [o.detach() for o in outs], dict(zip(leaves, grads))


def check_parity(edge: EdgeClassifier, path: Path, images: torch.Tensor) -> TrainingParity:
    """The saved module at ``path`` against the eager ``edge`` on ``images`` (and their flips as the
    consistency view): outputs within the fp32 bound, LoRA gradients within ``GRAD_MAX_REL_DIFF``."""
    x = images[:PARITY_BATCH].float()
    view = x.flip(-1)
    lora_names, weight_names = input_names(edge)
    lora = {n: edge.lora_tensors()[n] for n in lora_names}
    frozen = edge.frozen_tensors()
    weights = [frozen[n].detach() for n in weight_names]
    with quiet_torchscript():
        module = torch.jit.load(str(path), map_location="cpu")
    labels = torch.arange(len(x)) % edge.tensor("text.class_weights").shape[0]

    def scripted(tensors: dict[str, torch.Tensor]):
        return module(x, view, *(tensors[n] for n in lora_names), *weights)

    def eager(tensors: dict[str, torch.Tensor]):
        with no_mha_fastpath(), tensors_as_inputs(edge, tensors):
            features = edge.encode(x)
            return features, edge.logits(features), edge.encode_frozen(view)

    got, got_grads = _outputs_and_grads(scripted, lora, x, labels)
    want, want_grads = _outputs_and_grads(eager, lora, x, labels)
    out_diff = max(float((a - b).abs().max()) for a, b in zip(got, want))
    grad_diff = max(float((got_grads[n] - want_grads[n]).abs().max() / want_grads[n].abs().max().clamp_min(1e-12))
                    for n in lora_names)
    passed = out_diff <= FP32_MAX_ABS_DIFF and grad_diff <= GRAD_MAX_REL_DIFF
    return TrainingParity(images=len(x), max_abs_output_diff=float(f"{out_diff:.2e}"),
                          max_rel_grad_diff=float(f"{grad_diff:.2e}"), passed=passed)


def write_checked(edge: EdgeClassifier, image_size: int, path: Path, images: torch.Tensor) -> TrainingParity:
    """Trace and save the training module to ``path``, then hold it to the eager module (`check_parity`)."""
    export_training_module(edge, image_size, path)
    return check_parity(edge, path, images)


def manifest_section(edge: EdgeClassifier, parity: TrainingParity) -> dict:
    """The manifest's ``torchscript_training`` section: how to call the module, and its parity at export."""
    lora, weights = input_names(edge)
    return {"file": TORCHSCRIPT_TRAINING_FILE, "format": TORCHSCRIPT_FORMAT, "torch_version": torch.__version__,
            "load": "torch.jit.load(path)", "inputs": [*INPUT_NAMES[:2], *lora, *weights],
            "outputs": list(OUTPUT_NAMES), "lora_inputs": lora, "weight_inputs": weights,
            "weights_file": ROLES["weights"], "trainable": "lora", "numerics": "fp32",
            "parity": parity.to_manifest()}


__all__ = ["GRAD_MAX_REL_DIFF", "TrainingParity", "check_parity", "export_training_module", "input_names",
           "manifest_section", "write_checked"]
