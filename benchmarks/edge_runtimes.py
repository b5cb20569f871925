"""The edge table's OpenVINO rows and its ``auto`` row: what `edge-client --runtime auto` picks here.

Rows (``runtime`` column): ``openvino_fp32``, ``openvino_bf16`` (where the CPU plugin offers bf16),
``openvino_int8`` (the bundle's guarded int8 model compiled by OpenVINO) where openvino is installed,
and ``auto``: the engine `edge_client.runtime_choice.choose` picks for the fp32 bundle, verified on the
bundle's check images from an empty verdict cache (a temporary $FEDMVP_CACHE), as a device's first call
does. Each is timed with the other runtimes, interleaved (benchmarks/edge.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np


def _runner(engine: Any) -> Callable[[np.ndarray], list[np.ndarray]]:
    """``run(pixels)`` with the logits first, as the ONNX Runtime rows return them."""
    name = next(iter(engine.inputs))
    first = engine.outputs.index("logits")

    def run(pixels: np.ndarray) -> list[np.ndarray]:
        outputs = engine.run({name: pixels})
        return [outputs[first], *outputs[:first], *outputs[first + 1:]]
    return run


def runtime_runners(onnx: dict[str, Path], threads: int) -> tuple[dict[str, Callable], list[str], dict[str, Any]]:
    """``{row: run(pixels)}`` for the OpenVINO and auto rows, notes on what could not run, and auto's choice."""
    from benchmarks.edge_accuracy import fresh_verdicts
    from edge_client.bundle import Bundle
    from edge_client.engines import Candidate, offered, open_engine, unavailable
    from edge_client.runtime_choice import choose

    out: dict[str, Callable] = {}
    notes: list[str] = []
    fp32 = Bundle.open(onnx["ort_fp32"].parent)
    why = unavailable("openvino")
    if why is not None:
        notes.append(f"openvino rows: {why}")
    else:
        for precision in offered("openvino", fp32):
            out[f"openvino_{precision}"] = _runner(open_engine(fp32, Candidate("openvino", precision), threads=threads))
        if "ort_int8" in onnx:
            int8 = Bundle.open(onnx["ort_int8"].parent)
            try:
                out["openvino_int8"] = _runner(open_engine(int8, Candidate("openvino", "int8"), threads=threads))
            except Exception as err:  # noqa: BLE001 - a model OpenVINO cannot compile is a note, not a crash
                notes.append(f"openvino_int8: {' '.join(str(err).split())[:200]}")
    with fresh_verdicts():
        choice = choose(fp32, "auto", "auto", "cpu", threads)
        engine = choice.engine or open_engine(fp32, choice.candidate, "cpu", threads)
    out["auto"] = _runner(engine)
    picked = {k: v for k, v in choice.to_json().items() if k not in ("cache", "cached")}
    notes.append(choice.line.split("; cache ")[0])
    return out, notes, picked


def runtime_ratios(ms: dict[tuple[str, int], float], batches: list[int]) -> dict[str, float | None]:
    """auto and OpenVINO against ONNX Runtime fp32, at each batch of the table."""
    from benchmarks.common import ratio

    out: dict[str, float | None] = {}
    for b in batches:
        tag = f"b{b}"
        fp32 = ms.get(("ort_fp32", b))
        for row in ("auto", "openvino_fp32", "openvino_bf16", "openvino_int8"):
            out[f"{row}_vs_ort_fp32_{tag}"] = ratio(fp32, ms.get((row, b)))
    return out
