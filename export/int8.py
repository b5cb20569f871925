"""int8 with an accuracy guard: the layers whose quantisation flips predictions stay fp32.

Why: dynamic int8 (weights s8 per output channel, activations u8 per call) moves every
logit a little, and a model whose images often have near-tied top classes (small CLIPs, a
low logit scale, many similar classes) then changes its top-1 on a few percent of images.
Instead of shipping that, or giving up on int8, the export keeps the most sensitive MatMuls
in fp32 until the top-1 agreement with the fp32 model on calibration images (the run's
*training* images, so the parity check on test images stays an independent verdict) reaches
the target, both as observed and as expected (see ``expected_agreement``: a few dozen images
alone would let an unlucky or lucky draw decide).

Ranking costs one torch forward + backward per calibration image (up to 32), not one ONNX run
per layer: export/int8_sensitivity.py estimates, for every layer at once, how far its int8
error moves each image's top-1 margin (first order, the quantisers simulated as ONNX Runtime
does them; tests/export/test_int8_first_order.py checks it against real single-layer runs).
The summed estimates predict how many to keep; a real run verifies that (usually the only
one), and only a failed verification searches further (doubling from the prediction, then
bisection). Without a torch twin (``shifts`` None) each layer is quantised alone and run once
to rank them, as before (one ONNX run per layer: slow on a ViT). What the guard keeps, and how
long it takes, is measured by ``python -m benchmarks edge`` (docs/benchmarks.md), not here.

The criterion (``AccuracyTarget``, docs/architecture.md "int8"): with labelled held-out images of the
run (its test images, ``fedmvp-export --max-accuracy-drop``, points, default 1.0) the fewest layers are
kept whose int8 model's task accuracy on them is at most that many points below fp32's; agreement with
fp32 is reported beside it. Near-tied logits flip on int8 noise although they were a coin toss for fp32
too, so top-1 agreement of 99% keeps nearly every layer of a small CLIP while the accuracy does not move.
Without labelled images the criterion is agreement (``target``) on the calibration images, as before.
The first-order estimate predicts the count for the accuracy bound too: a flip costs accuracy on a
correctly classified image, so the agreement to predict for is 1 - bound / fp32 accuracy.

The quantisers (export/int8_quantize.py): weights s8 per output channel at 7 bits; the scheme
(``scheme``) "dynamic" (above) or "static" (QDQ, activation ranges calibrated once on the run's training
images, the kept layers left without Q/DQ); which one a bundle ships is measured per export
(export/int8_scheme.py, ``fedmvp-export --int8-scheme``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx

from export.int8_quantize import (SCHEMES, Int8Error, matmuls_as_matmul, quantizable_layers,  # noqa: F401
                                 quantize, quantize_dynamic_model, quantize_static_model)

DEFAULT_MAX_ACCURACY_DROP = 1.0  # points of top-1 accuracy int8 may lose on the labelled held-out images


@dataclass
class AccuracyTarget:
    """The task accuracy int8 must hold: labelled held-out images' fp32 logits, their classes, the bound.

    ``run(model)``: the candidate's logits on the same images, in the same order."""

    reference: np.ndarray  # [N, C] fp32 logits
    labels: np.ndarray  # [N] class indices
    max_drop_points: float
    run: Callable[[onnx.ModelProto], np.ndarray]

    @property
    def fp32(self) -> float:
        return _accuracy(self.reference, self.labels)

    def drop_points(self, logits: np.ndarray) -> float:
        return 100.0 * (self.fp32 - _accuracy(logits, self.labels))

    def prediction_target(self) -> float:
        """The agreement whose flips cost at most the bound if each lands on a correct image."""
        return float(np.clip(1.0 - self.max_drop_points / 100.0 / max(self.fp32, 1e-9), 0.0, 1.0))


@dataclass
class Int8Plan:
    """Which layers were quantised, which stayed fp32 and why (goes into the manifest)."""

    target_agreement: float
    calibration_images: int
    quantized: list[str] = field(default_factory=list)
    kept_fp32: list[str] = field(default_factory=list)
    calibration_agreement: float = 0.0
    calibration_expected_agreement: float = 0.0
    calibration_max_abs_logit_diff: float = 0.0
    searched: int = 0  # quantisations run to find the plan
    sensitivity: str = "first-order"  # how layers were ranked: "first-order" (torch estimate) or "per-layer"
    predicted_kept: int = -1  # layers the first-order estimate said to keep (-1: not estimated)
    criterion: str = "agreement"  # "accuracy" (AccuracyTarget) or "agreement" (target_agreement, calibration)
    scheme: str = "dynamic"  # SCHEMES: how the quantised layers compute (absent in older manifests: dynamic)
    # how the scheme was chosen (export/int8_scheme.py): asked, why, and what each candidate measured
    scheme_choice: dict | None = None
    # criterion "accuracy": {images, fp32, int8 (top-1 accuracies), drop_points, max_drop_points,
    # top1_agreement (int8 vs fp32, same images)}; the keys: fedmvp_formats.bundle_manifest.INT8_ACCURACY
    accuracy: dict | None = None

    def to_manifest(self) -> dict:
        out = asdict(self)
        out["calibration_agreement"] = round(self.calibration_agreement, 6)
        out["calibration_expected_agreement"] = round(self.calibration_expected_agreement, 6)
        out["calibration_max_abs_logit_diff"] = float(f"{self.calibration_max_abs_logit_diff:.2e}")
        return out

    def numerics(self) -> str:
        """The manifest's ``onnx.numerics`` of an int8 bundle: what its quantised layers compute in."""
        how = ("activations u8 per call (dynamic)" if self.scheme == "dynamic"
               else "activations u8 with ranges calibrated at export (static QDQ)")
        return (f"int8: MatMul weights s8 per output channel (7-bit range), {how}; the layers in "
                f"onnx.int8.kept_fp32, LoRA and everything else fp32")

    def line(self) -> str:
        total = len(self.quantized) + len(self.kept_fp32)
        head = (f"int8: {len(self.quantized)} of {total} MatMul layers quantised ({self.scheme}), "
                f"{len(self.kept_fp32)} kept fp32; ")
        calibration = (f"top-1 agreement {100 * self.calibration_agreement:.2f}% (expected "
                       f"{100 * self.calibration_expected_agreement:.2f}%) on {self.calibration_images} "
                       f"training images")
        if self.scheme_choice and self.scheme_choice.get("asked") == "auto":
            head += f"auto picked {self.scheme_choice['why']}; "
        if self.accuracy is None:
            return head + "calibration " + calibration
        a = self.accuracy
        return (head + f"accuracy {100 * a['fp32']:.2f}% fp32 -> {100 * a['int8']:.2f}% int8 (drop "
                f"{a['drop_points']:.2f} points, bound {a['max_drop_points']:g}; top-1 agreement "
                f"{100 * a['top1_agreement']:.2f}%) on {a['images']} labelled held-out images; " + calibration)


# run(model, limit) -> the model's logits on the first ``limit`` calibration images (all when None)
Run = Callable[[onnx.ModelProto, "int | None"], np.ndarray]
SENSITIVITY_IMAGES = 32


def _agreement(reference: np.ndarray, logits: np.ndarray) -> float:
    return float(np.mean(reference.argmax(-1) == logits.argmax(-1)))


def _accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(logits.argmax(-1) == labels)) if len(labels) else 0.0


def expected_agreement(reference: np.ndarray, logits: np.ndarray) -> float:
    """Top-1 agreement to expect on unseen images: the share of (i, j) pairs in which image i's
    shift of its top-1 vs runner-up logit gap is smaller than image j's fp32 gap.

    Why: on N images the observed agreement moves in steps of 1/N and depends on how many
    near-ties the draw holds; pairing every observed shift with every observed gap uses the
    N x N combinations and is what the parity check on other images then sees, or lower."""
    order = np.argsort(reference, axis=-1)
    rows = np.arange(len(reference))
    first, second = order[:, -1], order[:, -2]
    shift = logits - reference
    gaps = reference[rows, first] - reference[rows, second]
    shifts = np.abs(shift[rows, first] - shift[rows, second])
    return float(np.mean(shifts[:, None] < gaps[None, :]))


def predicted_agreement(shifts: np.ndarray, gaps: np.ndarray) -> tuple[float, float]:
    """Observed and expected (every shift vs every gap) agreement for per-image margin shifts ``shifts``."""
    shifts = np.abs(shifts)
    return float(np.mean(shifts < gaps)), float(np.mean(shifts[:, None] < gaps[None, :]))


def rank_first_order(layers: list[str], shifts: dict[str, np.ndarray]) -> list[str]:
    """Most sensitive first: sum over images of |estimated margin shift|; layers without an
    estimate first of all (nothing says they are safe)."""
    score = {name: float(np.sum(np.abs(shifts[name]))) if name in shifts else np.inf for name in layers}
    return sorted(layers, key=lambda n: (-score[n], layers.index(n)))


def predict_kept(ranked: list[str], shifts: dict[str, np.ndarray], reference: np.ndarray, target: float) -> int:
    """Fewest of ``ranked`` to keep fp32 so that the first-order shift of each image's margin
    (the sum of the quantised layers' estimates) predicts both agreements >= ``target``."""
    estimated = [name for name in ranked if name in shifts]
    unknown = len(ranked) - len(estimated)
    if not estimated:
        return len(ranked)
    matrix = np.stack([shifts[name] for name in estimated], axis=1)  # [N, L] in ranked order
    top = np.sort(reference[:len(matrix)], axis=-1)
    gaps = top[:, -1] - top[:, -2]
    # tail[:, k] = summed shift of the layers ranked after the k kept ones
    tail = np.concatenate([np.cumsum(matrix[:, ::-1], axis=1)[:, ::-1], np.zeros((len(matrix), 1))], axis=1)
    for kept in range(matrix.shape[1] + 1):
        observed, expected = predicted_agreement(tail[:, kept], gaps)
        if observed >= target and expected >= target:
            return unknown + kept
    return len(ranked)


def plan_int8(proto: onnx.ModelProto, keep_fp32_inputs: list[str], reference: np.ndarray, run: Run,
              target: float, progress: Callable[[str], None] | None = None,
              shifts: dict[str, np.ndarray] | None = None, accuracy: AccuracyTarget | None = None,
              scheme: str = "dynamic", calibration: np.ndarray | None = None) -> tuple[onnx.ModelProto, Int8Plan]:
    """The int8 model that quantises as many layers as it can while holding the criterion.

    ``proto``: the fp32 model (Gemm already rewritten, see ``matmuls_as_matmul``);
    ``reference``: fp32 logits on the calibration images; ``run``: see ``Run``;
    ``shifts``: layer -> per-image first-order margin shifts of the first calibration images
    (export/int8_sensitivity.py): rank and predict from them, then verify with real runs.
    Without them every layer is quantised alone and run once to rank them (slow).
    ``accuracy``: hold the task accuracy on labelled held-out images within its bound, with the fewest
    layers kept (searched down from the prediction too); None: top-1 agreement >= ``target`` with fp32 on
    the calibration images. ``scheme``: SCHEMES; "static" calibrates its activation ranges once on
    ``calibration`` (the images ``reference`` was computed on) and every candidate shares them."""
    if scheme not in SCHEMES:
        raise Int8Error(f"int8 scheme {scheme!r}: choose one of {', '.join(SCHEMES)}")
    with tempfile.TemporaryDirectory(prefix="fedmvp-int8-ranges-") as work:
        return _plan(proto, keep_fp32_inputs, reference, run, target, progress, shifts, accuracy, scheme,
                     calibration, Path(work) / "ranges.json")


def _plan(proto: onnx.ModelProto, keep_fp32_inputs: list[str], reference: np.ndarray, run: Run, target: float,
          progress: Callable[[str], None] | None, shifts: dict[str, np.ndarray] | None,
          accuracy: AccuracyTarget | None, scheme: str, calibration: np.ndarray | None,
          cache: Path) -> tuple[onnx.ModelProto, Int8Plan]:
    note = progress or (lambda _: None)
    layers = quantizable_layers(proto, keep_fp32_inputs)
    if not layers:
        raise Int8Error("the model has no MatMul with a constant weight to quantise")
    plan = Int8Plan(target_agreement=target, calibration_images=int(len(reference)),
                    sensitivity="first-order" if shifts is not None else "per-layer",
                    criterion="agreement" if accuracy is None else "accuracy", scheme=scheme)

    def attempt(kept: list[str]) -> Trial:
        note(f"int8 ({scheme}): keeping {len(kept)} most sensitive in fp32")
        model = quantize(proto, [name for name in layers if name not in kept], scheme, calibration, cache)
        plan.searched += 1
        if accuracy is None:
            return _calibrated(model, reference, run)
        out = accuracy.run(model)
        return Trial(model, _agreement(accuracy.reference, out), 0.0, 0.0, accuracy.drop_points(out))

    if accuracy is None:
        good = lambda trial: trial.agreement >= target and trial.expected >= target  # noqa: E731
    else:
        good = lambda trial: trial.drop_points <= accuracy.max_drop_points  # noqa: E731
    if shifts is not None:
        ranked = rank_first_order(layers, shifts)
        aim = target if accuracy is None else accuracy.prediction_target()
        plan.predicted_kept = predict_kept(ranked, shifts, reference, aim)
        kept, best = _search(ranked, plan.predicted_kept, attempt, good, fewest=accuracy is not None)
    else:
        kept, best = _per_layer_plan(proto, layers, reference, run, plan, note, attempt, good,
                                     lambda name: quantize(proto, [name], scheme, calibration, cache))
    if accuracy is not None:
        plan.accuracy = {"images": int(len(accuracy.labels)), "fp32": round(accuracy.fp32, 6),
                         "int8": round(accuracy.fp32 - best.drop_points / 100.0, 6),
                         "drop_points": round(best.drop_points, 4), "max_drop_points": accuracy.max_drop_points,
                         "top1_agreement": round(best.agreement, 6)}
        best = _calibrated(best.model, reference, run)  # the calibration agreement, reported beside it
    plan.calibration_agreement, plan.calibration_expected_agreement = best.agreement, best.expected
    plan.calibration_max_abs_logit_diff = best.max_diff
    plan.kept_fp32 = kept
    plan.quantized = [name for name in layers if name not in kept]
    return best.model, plan


def _calibrated(model: onnx.ModelProto, reference: np.ndarray, run: Run) -> Trial:
    """``model``'s agreement with fp32 on the calibration images (one real run)."""
    out = run(model, None)
    return Trial(model, _agreement(reference, out), expected_agreement(reference, out),
                 float(np.max(np.abs(out - reference))))


@dataclass
class Trial:
    """One real ONNX Runtime run of a candidate int8 model: its agreement with fp32 (on the calibration
    images, or with an accuracy target on its labelled images) and, there, its accuracy drop in points."""

    model: onnx.ModelProto
    agreement: float
    expected: float
    max_diff: float
    drop_points: float = 0.0


def _search(ranked: list[str], start: int, attempt: Callable[[list[str]], Trial],
            good: Callable[[Trial], bool], low: int = -1, fewest: bool = False) -> tuple[list[str], Trial]:
    """Verify keeping ``ranked[:start]``; if that fails, keep more in doubling steps, then bisect
    between the last failure and the first success (``low``: a count known to fail). ``fewest``: when
    the start already passes, try keeping none, then bisect down (the accuracy bound asks for the fewest)."""
    count, step = start, 1
    trial = attempt(ranked[:count])
    while not good(trial) and count < len(ranked):
        low, count, step = count, min(len(ranked), count + step), step * 2
        trial = attempt(ranked[:count])
    best = trial
    if fewest and low < 0 and count > 0 and good(best):
        none = attempt([])
        if good(none):
            return [], none
        low = 0
    while count - low > 1 and low >= 0:
        middle = (low + count) // 2
        trial = attempt(ranked[:middle])
        if good(trial):
            count, best = middle, trial
        else:
            low = middle
    return ranked[:count], best


def _per_layer_plan(proto: onnx.ModelProto, layers: list[str], reference: np.ndarray, run: Run, plan: Int8Plan,
                    note: Callable[[str], None], attempt: Callable[[list[str]], Trial],
                    good: Callable[[Trial], bool],
                    alone: Callable[[str], onnx.ModelProto]) -> tuple[list[str], Trial]:
    """The fallback without a torch twin: all layers first, else rank by quantising each alone."""
    best = attempt([])
    if good(best):
        return [], best
    sensitivity, few = {}, reference[:SENSITIVITY_IMAGES]
    for i, name in enumerate(layers):
        note(f"int8: sensitivity {i + 1}/{len(layers)}")
        only = run(alone(name), SENSITIVITY_IMAGES)
        plan.searched += 1
        sensitivity[name] = float(np.mean(np.abs(only - few)))
    ranked = sorted(layers, key=lambda n: (-sensitivity[n], layers.index(n)))
    return _search(ranked, 1, attempt, good, low=0)
