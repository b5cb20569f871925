"""ExecuTorch export of the ``EdgeClassifier``: ``model.pte`` for phones, its LoRA tensors as inputs.

Why: ExecuTorch is PyTorch's on-device runtime (Android, iOS, embedded); a phone app loads ``model.pte``
with its C++/Java/Swift runtime without Python or ONNX Runtime (docs/howto/executorch.md). The module is
the one ONNX and TorchScript are exported from (``torchscript_export._LoraInputs``: pixel_values, then the
LoRA tensors in ``lora_names`` order, in; logits, probs, image_embeds out), ``torch.export``-ed, lowered to
the XNNPACK backend (``to_edge_transform_and_lower``) and serialised (``to_executorch().buffer``).
The batch is dynamic, 1 to ``MAX_BATCH`` images per call (ExecuTorch plans memory for the upper bound, so a
phone's arena stays that of ``MAX_BATCH`` images); a device splits larger runs. executorch 1.5.1's IR
verifier specialises a dynamic batch to the example's size (its dtype check reads a symbolic length; the
program then refuses any other batch, docs/howto/executorch.md), so it is switched off
(``_check_ir_validity=False``): what the verifier would catch, a wrong program, the parity check catches.
executorch is the optional extra ``[executorch]``: imported only here, when the export asks for it.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import numpy as np
import torch

from fedmvp_formats.bundle_manifest import EXECUTORCH_FILE, EXECUTORCH_FORMAT

from edge_client.executorch_runtime import load_method, run_batches
from export import parity
from export.edge_module import EdgeClassifier, no_mha_fastpath
from export.errors import ExportError
from export.onnx_export import INPUT_NAME, OUTPUT_NAMES, plain_attention
from export.torchscript_export import _LoraInputs

__all__ = ["EXECUTORCH_FILE", "MAX_BATCH", "ExecuTorchParity", "export_pte", "logits", "manifest_section",
           "write_checked"]

MAX_BATCH = 8  # the most images one call of the program's forward takes (its memory is planned for this)
BACKEND = "xnnpack"


def _executorch() -> tuple:
    """(to_edge_transform_and_lower, XnnpackPartitioner, EdgeCompileConfig), or ExportError saying how to
    install them."""
    try:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    except ImportError as err:
        raise ExportError(f"--format executorch needs executorch: pip install 'fedmvp[executorch]' ({err})") from err
    return to_edge_transform_and_lower, XnnpackPartitioner, EdgeCompileConfig


def export_pte(edge: EdgeClassifier, image_size: int, path: Path) -> None:
    """``torch.export`` ``edge`` (LoRA as inputs, batch 1 to ``MAX_BATCH``), lower it to XNNPACK, write ``path``."""
    lower, partitioner, config = _executorch()
    example = torch.zeros(2, 3, image_size, image_size)  # traced at 2: a batch of 1 would be specialised
    lora = tuple(t.detach().clone() for t in edge.lora_tensors().values())
    shapes = ({0: torch.export.Dim("batch", min=1, max=MAX_BATCH)}, tuple(None for _ in lora))
    wrapper = _LoraInputs(edge).eval()
    with no_mha_fastpath(), plain_attention(edge), torch.no_grad():
        exported = torch.export.export(wrapper, (example, *lora), dynamic_shapes=shapes, strict=False)
    program = lower(exported, partitioner=[partitioner()],
                    compile_config=config(_check_ir_validity=False)).to_executorch()
    Path(path).write_bytes(program.buffer)


def logits(path: Path, images: torch.Tensor, lora: dict[str, torch.Tensor], names: list[str]) -> np.ndarray:
    """[N, C] logits of the program at ``path`` on ``images`` with ``lora`` fed (``names`` order)."""
    feed = [lora[n].detach().float().numpy() for n in names]
    return run_batches(load_method(path), images.float().numpy(), feed, MAX_BATCH)[0]


def manifest_section(edge: EdgeClassifier, promptformer_digest: str | None) -> dict:
    """The manifest's ``executorch`` section: how to call the program, and the PromptFormer baked in (a
    refresh rewrites weights.safetensors but not this file, so the device offers it only while they agree)."""
    return {"file": EXECUTORCH_FILE, "format": EXECUTORCH_FORMAT, "backend": BACKEND,
            "executorch_version": importlib.metadata.version("executorch"), "method": "forward",
            "batch": "dynamic", "max_batch": MAX_BATCH, "inputs": [INPUT_NAME, *edge.lora_names],
            "outputs": list(OUTPUT_NAMES),
            "lora_inputs": list(edge.lora_names), "numerics": "fp32", "promptformer_digest": promptformer_digest}


class ExecuTorchParity(parity.ParityResult):
    """fp32 parity of the ExecuTorch program against PyTorch (same rules as the ONNX model's); its own line."""

    def line(self) -> str:
        return "executorch " + super().line()


def write_checked(edge: EdgeClassifier, image_size: int, path: Path, reference: np.ndarray,
                  images: torch.Tensor) -> ExecuTorchParity:
    """Lower and write ``edge`` to ``path``, then hold the program read back by ExecuTorch's runtime to
    the fp32 parity rules (logit bound and top-1 agreement) against ``reference``, PyTorch's logits."""
    export_pte(edge, image_size, path)
    found = parity.compare(reference, logits(path, images, edge.lora_tensors(), list(edge.lora_names)), "fp32")
    return ExecuTorchParity(**vars(found))
