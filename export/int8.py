"""Dynamic int8 with an accuracy guard: the layers whose quantisation flips predictions stay fp32.

Why: dynamic int8 (weights s8 per output channel, activations u8 per call) moves every
logit a little, and a model whose images often have near-tied top classes (small CLIPs, a
low logit scale, many similar classes) then changes its top-1 on a few percent of images.
Instead of shipping that, or giving up on int8, the export measures on calibration images
(the run's *training* images, so the parity check on test images stays an independent
verdict) how far quantising each MatMul alone moves the logits (on the first 32 of them: a
ranking needs fewer images than a verdict, and these runs are most of the cost on a big
model), and keeps the most sensitive ones in fp32 until the top-1 agreement with the fp32
model reaches the target,
both as observed and as expected (see ``expected_agreement``: a few dozen images alone
would let an unlucky or lucky draw decide).
This is the usual accuracy-driven mixed precision of quantisation toolkits, kept small: one
quantisation per layer to rank them, then a doubling search over how many to keep (about
2 log2(layers) more). A model that already agrees keeps every layer quantised and costs one.
(Ranking by the error each layer adds to its own output, from one run of the fully quantised
model, costs two runs instead of one per layer, but on the demo model it kept 21 of 22 layers
in fp32 where the logit ranking keeps 17.)

Weights use 7 bits (``reduce_range``): x86 CPUs without VNNI saturate in the u8 x s8
multiply-add at 8 bits, and the bundle must behave the same on whatever device runs it.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx

QUANTIZED_OPS = ("MatMul",)  # Gemm is rewritten to MatMul + Add first (what the quantizer does itself)


class Int8Error(RuntimeError):
    """The model could not be quantised as asked."""


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

    def to_manifest(self) -> dict:
        out = asdict(self)
        out["calibration_agreement"] = round(self.calibration_agreement, 6)
        out["calibration_expected_agreement"] = round(self.calibration_expected_agreement, 6)
        out["calibration_max_abs_logit_diff"] = float(f"{self.calibration_max_abs_logit_diff:.2e}")
        return out

    def line(self) -> str:
        total = len(self.quantized) + len(self.kept_fp32)
        return (f"int8: {len(self.quantized)} of {total} MatMul layers quantised, {len(self.kept_fp32)} kept fp32; "
                f"calibration top-1 agreement {100 * self.calibration_agreement:.2f}% (expected "
                f"{100 * self.calibration_expected_agreement:.2f}%) on {self.calibration_images} training images")


def matmuls_as_matmul(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy with every Gemm rewritten as MatMul (+ Add), so layer names are stable across calls."""
    from onnxruntime.quantization.onnx_model import ONNXModel

    out = onnx.ModelProto()
    out.CopyFrom(proto)
    ONNXModel(out).replace_gemm_with_matmul()
    return out


def quantizable_layers(proto: onnx.ModelProto, keep_fp32_inputs: list[str]) -> list[str]:
    """MatMul nodes with a constant weight, except those reading any of ``keep_fp32_inputs``."""
    constants = {init.name for init in proto.graph.initializer} - set(keep_fp32_inputs)
    keep = set(keep_fp32_inputs)
    return [node.name for node in proto.graph.node
            if node.op_type in QUANTIZED_OPS and len(node.input) == 2 and node.input[1] in constants
            and not set(node.input) & keep]


def quantize(proto: onnx.ModelProto, layers: list[str]) -> onnx.ModelProto:
    """Dynamic int8 of exactly ``layers`` (per-channel s8 weights, 7-bit range)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    if not layers:
        out = onnx.ModelProto()
        out.CopyFrom(proto)
        return out
    with _quiet(), tempfile.TemporaryDirectory(prefix="fedmvp-int8-") as work:
        src, dst = Path(work) / "fp32.onnx", Path(work) / "int8.onnx"
        src.write_bytes(proto.SerializeToString(deterministic=True))
        quantize_dynamic(src, dst, op_types_to_quantize=list(QUANTIZED_OPS), weight_type=QuantType.QInt8,
                         per_channel=True, reduce_range=True, nodes_to_quantize=list(layers))
        out = onnx.load(str(dst))
    done = sum(node.op_type == "MatMulInteger" for node in out.graph.node)
    if done != len(layers):
        raise Int8Error(f"asked to quantise {len(layers)} MatMul layers, the quantiser did {done}")
    return out


# run(model, limit) -> the model's logits on the first ``limit`` calibration images (all when None)
Run = Callable[[onnx.ModelProto, "int | None"], np.ndarray]
SENSITIVITY_IMAGES = 32


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The quantiser logs advice ("consider pre-processing") on the root logger on every call."""
    loggers = [logging.getLogger(), logging.getLogger("onnxruntime")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _agreement(reference: np.ndarray, logits: np.ndarray) -> float:
    return float(np.mean(reference.argmax(-1) == logits.argmax(-1)))


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


def plan_int8(proto: onnx.ModelProto, keep_fp32_inputs: list[str], reference: np.ndarray, run: Run,
              target: float, progress: Callable[[str], None] | None = None) -> tuple[onnx.ModelProto, Int8Plan]:
    """The int8 model that quantises as many layers as it can while agreeing with ``reference``.

    ``proto``: the fp32 model (Gemm already rewritten, see ``matmuls_as_matmul``);
    ``reference``: fp32 logits on the calibration images; ``run``: see ``Run``."""
    note = progress or (lambda _: None)
    layers = quantizable_layers(proto, keep_fp32_inputs)
    if not layers:
        raise Int8Error("the model has no MatMul with a constant weight to quantise")
    plan = Int8Plan(target_agreement=target, calibration_images=int(len(reference)))

    def attempt(kept: list[str]) -> tuple[onnx.ModelProto, float, float, float]:
        model = quantize(proto, [name for name in layers if name not in kept])
        out = run(model, None)
        plan.searched += 1
        return (model, _agreement(reference, out), expected_agreement(reference, out),
                float(np.max(np.abs(out - reference))))

    def good(trial: tuple[onnx.ModelProto, float, float, float]) -> bool:
        return trial[1] >= target and trial[2] >= target

    note("int8: all layers")
    best = attempt([])
    kept: list[str] = []
    if not good(best):
        sensitivity, few = {}, reference[:SENSITIVITY_IMAGES]
        for i, name in enumerate(layers):
            note(f"int8: sensitivity {i + 1}/{len(layers)}")
            only = run(quantize(proto, [name]), SENSITIVITY_IMAGES)
            plan.searched += 1
            sensitivity[name] = float(np.mean(np.abs(only - few)))
        ranked = sorted(layers, key=lambda n: (-sensitivity[n], layers.index(n)))
        low, high, found = 0, 1, None  # doubling, then bisection, on how many of the ranked to keep
        while found is None:
            high = min(high, len(ranked))
            note(f"int8: keeping {high} most sensitive in fp32")
            trial = attempt(ranked[:high])
            if good(trial) or high == len(ranked):
                found = (high, trial)
            else:
                low, high = high, high * 2
        high, best = found
        while high - low > 1:
            middle = (low + high) // 2
            note(f"int8: keeping {middle} most sensitive in fp32")
            trial = attempt(ranked[:middle])
            if good(trial):
                high, best = middle, trial
            else:
                low = middle
        kept = ranked[:high]
    model, observed, expected, max_diff = best
    plan.calibration_agreement, plan.calibration_expected_agreement = observed, expected
    plan.calibration_max_abs_logit_diff = max_diff
    plan.kept_fp32 = kept
    plan.quantized = [name for name in layers if name not in kept]
    return model, plan
