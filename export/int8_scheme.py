"""Which int8 scheme a bundle ships, dynamic or static (QDQ), chosen by measurement at export.

Why measured, not fixed: on ViT-B-16-shaped MatMuls alone static is 1.6x faster than dynamic at
batch 8 on an AVX-512 VNNI CPU, while on the whole bundle it was slower on another (the Q/DQ pairs
around every MatMul and the unfused rest of the graph; docs/architecture.md "int8" has the
figures), and static's calibrated ranges can cost more accuracy, which the guard then pays for with
more layers kept fp32. So ``auto`` plans both under the same criterion (export/int8.py: the same
first-order ranking, real ONNX Runtime runs decide the count), times both bundles' models at batch 8
on this machine's CPU (interleaved, median), and ships the faster. Both hold the criterion by
construction (the search ends at keeping every layer fp32 at worst), so speed alone decides.

``--int8-scheme dynamic|static`` plans that one only (reproducible bytes: ``auto``'s pick and its
timings depend on the machine and its load). The manifest's ``onnx.int8.scheme`` says what shipped,
``onnx.int8.scheme_choice`` how: asked, why, and per candidate its kept layers, its accuracy drop
(or calibration agreement) and its ms per image at batch 8.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx

from export.int8 import SCHEMES, AccuracyTarget, Int8Plan, Run, plan_int8

CHOICES = ("auto", *SCHEMES)
DEFAULT_SCHEME = "auto"
TIMING_BATCH = 8
TIMING_REPEATS = 5


def int8_scheme_for(asked: str, real_calibration: int) -> tuple[str, str | None]:
    """The scheme to plan for ``asked`` and, where no real image can calibrate static's activation ranges
    (``real_calibration`` 0: an open-membership run exported without data), the one warning line why."""
    from export.errors import ExportError

    if asked not in CHOICES:
        raise ExportError(f"--int8-scheme {asked!r}: choose one of {', '.join(CHOICES)}")
    if real_calibration > 0 or asked == "dynamic":
        return asked, None
    if asked == "auto":
        return "dynamic", ("int8: dynamic quantisation (auto): no real calibration images (neither the run's "
                           "training images nor --images), and static int8 would calibrate its activation "
                           "ranges on generated pixels")
    return "static", ("int8: static quantisation as asked, its activation ranges calibrated on generated pixels "
                      "(no real calibration images: neither the run's training images nor --images)")


def plan_scheme(proto: onnx.ModelProto, lora_names: list[str], reference: np.ndarray, run: Run, target: float,
                calibration: np.ndarray, scheme: str = DEFAULT_SCHEME, real_calibration: int | None = None,
                progress: Callable[[str], None] | None = None, shifts: dict[str, np.ndarray] | None = None,
                accuracy: AccuracyTarget | None = None) -> tuple[onnx.ModelProto, Int8Plan]:
    """The int8 model of ``scheme`` (``auto``: the faster at batch 8 of both, each planned under the same
    criterion) and its plan, ``scheme_choice`` filled in. ``real_calibration``: how many of ``calibration``
    are real images (None: all; 0 makes auto dynamic, see ``int8_scheme_for``). Other arguments:
    ``export.int8.plan_int8``'s; ``calibration`` are the images ``reference`` was computed on, static's
    ranges are calibrated on them."""
    asked = scheme
    scheme, why = int8_scheme_for(asked, len(calibration) if real_calibration is None else real_calibration)
    candidates = SCHEMES if scheme == "auto" else (scheme,)
    plans = {name: plan_int8(proto, lora_names, reference, run, target, progress, shifts, accuracy, name,
                             calibration) for name in candidates}
    if scheme != "auto":
        model, plan = plans[scheme]
        plan.scheme_choice = {"asked": asked, "why": why or "asked by name",
                              "candidates": {scheme: _figures(plan, None)}}
        return model, plan
    if progress:
        progress(f"int8: timing {' and '.join(candidates)} at batch {TIMING_BATCH}")
    ms = time_models({name: model for name, (model, _) in plans.items()}, calibration[:TIMING_BATCH])
    picked = min(candidates, key=lambda name: ms[name])
    model, plan = plans[picked]
    other = next(name for name in candidates if name != picked)
    plan.scheme_choice = {"asked": "auto",
                          "why": f"{picked}: faster at batch {TIMING_BATCH} on this machine ({ms[picked]:.1f} against "
                                 f"{ms[other]:.1f} ms per image for {other}), both holding the {plan.criterion} "
                                 f"criterion",
                          "candidates": {name: _figures(p, ms[name]) for name, (_, p) in plans.items()}}
    return model, plan


def _figures(plan: Int8Plan, ms: float | None) -> dict:
    """What one candidate measured: its kept layers, how it held the criterion, its speed here."""
    held = ({"drop_points": plan.accuracy["drop_points"]} if plan.accuracy is not None
            else {"calibration_agreement": round(plan.calibration_agreement, 6)})
    return {"kept_fp32": len(plan.kept_fp32), "quantized": len(plan.quantized), **held,
            "ms_per_image_b8": None if ms is None else round(ms, 2)}


def time_models(models: dict[str, onnx.ModelProto], pixels: np.ndarray, repeats: int = TIMING_REPEATS,
                threads: int | None = None) -> dict[str, float]:
    """Median ms per image of each model on ``pixels`` (one batch), ONNX Runtime's CPU provider with
    ``threads`` (default: this machine's cores), run round-robin so that load hits all of them alike."""
    from edge_client.runtime import make_session

    with tempfile.TemporaryDirectory(prefix="fedmvp-int8-time-") as work:
        sessions = {}
        for name, model in models.items():
            path = Path(work) / f"{name}.onnx"
            path.write_bytes(model.SerializeToString())
            sessions[name], _ = make_session(path, "cpu", threads=threads)
        feeds = {name: {s.get_inputs()[0].name: pixels} for name, s in sessions.items()}
        for name, session in sessions.items():  # warm-up: first-run allocations and kernel selection
            session.run(None, feeds[name])
        times: dict[str, list[float]] = {name: [] for name in sessions}
        for _ in range(repeats):
            for name, session in sessions.items():
                start = time.perf_counter()
                session.run(None, feeds[name])
                times[name].append(time.perf_counter() - start)
    return {name: 1000.0 * statistics.median(values) / len(pixels) for name, values in times.items()}
