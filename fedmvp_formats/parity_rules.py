"""The parity rules: when a model's logits count as the same model's as a reference's.

Why here: the exporter holds each precision it writes to these rules against PyTorch fp32
(``export/parity.py``), and the device holds each runtime and precision it may pick to the same
rules against the bundle as exported (``edge_client/runtime_choice.py``); one copy, numpy only.
fp32 must agree on every image and stay within ``FP32_MAX_ABS_DIFF``; a reduced precision must
agree on at least ``MIN_AGREEMENT`` of the *decisive* images: those whose reference top-1 margin is at
least ``NEAR_TIE_REL`` of the reference logits' range, of which there must be ``MIN_DECISIVE`` (or every
image, where fewer were checked): agreement on no decisive image verifies nothing. An image whose two best classes are closer than
that is a coin toss for fp32 itself, and any rounding decides it: on the trained demo bundle OpenVINO
bf16 flipped 1 of 32 check images (margin 0.09% of the range) and 2 of 256 test images (0.07%, 0%)
at no cost in accuracy (docs/benchmarks.md), and 99% of 32 images means all 32. The device adds a
logit bound for reduced precisions (``REDUCED_MAX_REL_DIFF`` of the reference's logit range): top-1
agreement alone would pass a runtime whose logits are off in scale (docs/architecture.md, "Runtimes").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FP32_MAX_ABS_DIFF = 1e-3
MIN_AGREEMENT = {"fp32": 1.0, "bf16": 0.99, "fp16": 0.99, "int8": 0.99}
REDUCED_MAX_REL_DIFF = 0.1  # the device's bound for bf16/fp16/int8: a tenth of the reference logits' range
NEAR_TIE_REL = 0.01  # a reference top-1 margin under 1% of its logit range: a near tie, not judged (reduced only)
MIN_DECISIVE = 8  # a reduced precision is judged on at least this many decisive images (all, where fewer exist):
# on a bundle whose check images were all near-tied, `auto` once passed bf16 "on the 0 not near-tied"


@dataclass(frozen=True)
class Agreement:
    """How far ``candidate``'s logits are from ``reference``'s, and whether that passes the rules."""

    precision: str
    images: int
    max_abs_logit_diff: float
    top1_agreement: float  # on every image
    max_allowed_diff: float | None  # None: no logit bound for this precision here
    passed: bool
    decisive_images: int = 0  # reduced precisions: the images judged (reference margin >= NEAR_TIE_REL)
    decisive_agreement: float = 1.0  # top-1 agreement on those: what MIN_AGREEMENT holds

    def describe(self) -> str:
        bound = f" (allowed {self.max_allowed_diff:.2e})" if self.max_allowed_diff is not None else ""
        need = 100 * MIN_AGREEMENT[self.precision]
        if self.precision == "fp32":
            judged = f"top-1 agreement {100 * self.top1_agreement:.2f}% (need >= {need:g}%)"
        elif self.decisive_images < min(MIN_DECISIVE, self.images):
            judged = (f"top-1 agreement {100 * self.top1_agreement:.2f}%, but only {self.decisive_images} of the "
                      f"images are not near-tied: too few decide it (need >= {min(MIN_DECISIVE, self.images)}), "
                      f"not verified")
        else:
            judged = (f"top-1 agreement {100 * self.top1_agreement:.2f}%, on the {self.decisive_images} not near-tied "
                      f"{100 * self.decisive_agreement:.2f}% (need >= {need:g}%)")
        return f"{self.images} images, max |logit diff| {self.max_abs_logit_diff:.2e}{bound}, {judged}"


def agreement(reference: np.ndarray, candidate: np.ndarray, precision: str,
              bound_reduced: bool = False) -> Agreement:
    """``reference`` and ``candidate``: [N, C] logits. fp32: 100% top-1 and max |diff| <= FP32_MAX_ABS_DIFF;
    others: MIN_AGREEMENT, and with ``bound_reduced`` max |diff| <= REDUCED_MAX_REL_DIFF * range(reference)."""
    if precision not in MIN_AGREEMENT:
        raise ValueError(f"precision {precision!r}: choose one of {', '.join(MIN_AGREEMENT)}")
    ref = np.asarray(reference, dtype=np.float64)
    got = np.asarray(candidate, dtype=np.float64)
    if ref.shape != got.shape or ref.ndim != 2 or not len(ref):
        raise ValueError(f"logits of shapes {ref.shape} and {got.shape} cannot be compared")
    diff = float(np.max(np.abs(ref - got))) if np.all(np.isfinite(got)) else float("inf")
    same = ref.argmax(-1) == got.argmax(-1)
    top1 = float(np.mean(same))
    if precision == "fp32":
        allowed: float | None = FP32_MAX_ABS_DIFF
        decisive = np.ones(len(ref), bool)
    else:
        allowed = REDUCED_MAX_REL_DIFF * float(np.ptp(ref)) if bound_reduced else None
        decisive = top1_margins(ref) >= NEAR_TIE_REL * float(np.ptp(ref))
    judged = float(np.mean(same[decisive])) if decisive.any() else 1.0
    enough = int(decisive.sum()) >= min(MIN_DECISIVE, len(ref))  # images that decide it, not coin tosses
    passed = enough and judged >= MIN_AGREEMENT[precision] and (allowed is None or diff <= allowed)
    return Agreement(precision=precision, images=int(len(ref)), max_abs_logit_diff=diff, top1_agreement=top1,
                     max_allowed_diff=allowed, passed=bool(passed), decisive_images=int(decisive.sum()),
                     decisive_agreement=judged)


def top1_margins(logits: np.ndarray) -> np.ndarray:
    """Each row's best logit minus its second best (0 with a single class)."""
    if logits.shape[-1] < 2:
        return np.zeros(len(logits))
    best_two = np.sort(logits, axis=-1)[:, -2:]
    return best_two[:, 1] - best_two[:, 0]
