"""ONNX Runtime (CPU) vs PyTorch on the same images: max |logit difference| and top-1 agreement.

The PyTorch side is the training core's own ``FedMVP`` forward (not the export wrapper), so
the check covers the rewrite of the text side into constants as well as the exporter.
Numbers are rounded before they go into the manifest so that exporting the same round
twice writes the same bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from fedmvp_formats.parity_rules import FP32_MAX_ABS_DIFF, MIN_AGREEMENT, agreement

from fedmvp.model import FedMVP

__all__ = ["FP32_MAX_ABS_DIFF", "MIN_AGREEMENT", "MIN_IMAGES", "ParityResult", "check", "compare"]
MIN_IMAGES = 32


@dataclass
class ParityResult:
    """One precision's comparison against PyTorch fp32."""

    precision: str
    images: int
    max_abs_logit_diff: float
    top1_agreement: float
    passed: bool
    decisive_images: int | None = None  # reduced precisions: the images not near-tied for fp32 (the rules')
    decisive_agreement: float | None = None  # top-1 agreement on those: what the rules hold

    def to_manifest(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def line(self) -> str:
        verdict = "ok" if self.passed else "FAILED"
        need = MIN_AGREEMENT[self.precision]
        extra = f", need <= {FP32_MAX_ABS_DIFF:g}" if self.precision == "fp32" else ""
        judged = "" if self.decisive_agreement is None else \
            f", on the {self.decisive_images} not near-tied {100 * self.decisive_agreement:.2f}%"
        return (f"parity {self.precision}: {self.images} images, max |logit diff| {self.max_abs_logit_diff:.2e}"
                f"{extra}, top-1 agreement {100 * self.top1_agreement:.2f}%{judged} (need >= {100 * need:g}%): {verdict}")


@torch.no_grad()
def torch_logits(model: FedMVP, images: torch.Tensor, batch_size: int = 32) -> np.ndarray:
    """[N, C] logits of the PyTorch model (its text features must already be set)."""
    model.eval()
    device = model.logit_scale.device
    chunks = [model(images[i:i + batch_size].to(device)).float().cpu() for i in range(0, len(images), batch_size)]
    return torch.cat(chunks).numpy()


def onnx_outputs(path: Path, images: np.ndarray, batch_size: int = 32, threads: int = 2) -> dict[str, np.ndarray]:
    """Every output of the ONNX model on ``images`` (CPU provider, fixed thread count)."""
    import onnxruntime as ort

    from edge_client.runtime import make_session

    ort.set_default_logger_severity(3)
    session, _ = make_session(path, "cpu", threads=threads)
    names = [o.name for o in session.get_outputs()]
    parts: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for start in range(0, len(images), batch_size):
        outs = session.run(None, {session.get_inputs()[0].name: images[start:start + batch_size]})
        for name, value in zip(names, outs):
            parts[name].append(value)
    return {n: np.concatenate(v) for n, v in parts.items()}


def compare(reference: np.ndarray, candidate: np.ndarray, precision: str) -> ParityResult:
    """Max |diff| and top-1 agreement by the parity rules (fedmvp_formats/parity_rules.py): fp32 must
    also stay within FP32_MAX_ABS_DIFF."""
    found = agreement(reference, candidate, precision)
    return ParityResult(precision=precision, images=found.images,
                        max_abs_logit_diff=float(f"{found.max_abs_logit_diff:.2e}"),
                        top1_agreement=round(found.top1_agreement, 6), passed=found.passed,
                        **({} if precision == "fp32" else {"decisive_images": found.decisive_images,
                                                           "decisive_agreement": round(found.decisive_agreement, 6)}))


def check(path: Path, reference: np.ndarray, images: torch.Tensor, precision: str) -> ParityResult:
    """Run the ONNX model at ``path`` and compare its logits with ``reference``."""
    logits = onnx_outputs(path, images.numpy().astype(np.float32))["logits"]
    return compare(reference, logits, precision)
