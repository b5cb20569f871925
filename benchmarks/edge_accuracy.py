"""What `auto` and OpenVINO bf16 cost in task accuracy on a trained run (the goal: where auto's top-1
agreement with fp32 is not 100%, it must stay within 1 point of fp32's accuracy on the trained demo run).

The run's round is exported as an fp32 bundle (its check images the run's test images, as a device
gets it); the labelled held-out images are the ones int8's accuracy bound is measured on, by the same
loader (``export.run_inputs.export_images``: the run's test images, each labelled with its class's
index in the bundle), preprocessed by the device's preprocessing. Each runtime runs them: ONNX Runtime
fp32 (the bundle as exported, the reference), what ``edge_client.runtime_choice.choose`` picks from an
empty verdict cache (``auto``), and OpenVINO bf16 where this CPU offers it. Reported per runtime: top-1
accuracy, the drop in points against fp32, top-1 agreement with fp32.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

BATCH = 8


@contextmanager
def fresh_verdicts() -> Iterator[None]:
    """An empty, temporary $FEDMVP_CACHE: `auto` verifies and times as on a device's first call."""
    previous = os.environ.get("FEDMVP_CACHE")
    with tempfile.TemporaryDirectory(prefix="fedmvp-bench-verdicts-") as cache:
        os.environ["FEDMVP_CACHE"] = cache
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop("FEDMVP_CACHE", None)
            else:
                os.environ["FEDMVP_CACHE"] = previous


def labelled_images(run_path: Path, bundle: Any, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Up to ``count`` of the run's test images whose class is one of the bundle's, preprocessed as the
    device does, and their class indices: int8's labelled images, by its loader."""
    import torch

    from edge_client.preprocess import preprocess
    from export.run_inputs import export_images
    from fedmvp.runs import RunDir

    spec = bundle.preprocess
    chosen = export_images(RunDir(run_path), lambda image: torch.from_numpy(preprocess(image, spec)),
                           spec.image_size, count, None, int8=False, class_names=bundle.class_names)
    known = chosen.labels >= 0
    return chosen.parity.numpy()[known].astype(np.float32), chosen.labels[known]


def logits(engine: Any, pixels: np.ndarray) -> np.ndarray:
    """The engine's logits on ``pixels``, BATCH at a time."""
    name, index = next(iter(engine.inputs)), engine.outputs.index("logits")
    dtype = engine.inputs.get(name, np.float32)
    return np.concatenate([engine.run({name: np.ascontiguousarray(pixels[i:i + BATCH], dtype=dtype)})[index]
                           for i in range(0, len(pixels), BATCH)])


def trained_runtimes(run_path: Path, work: Path, threads: int, count: int) -> dict[str, Any]:
    """fp32, auto and OpenVINO bf16 on the trained run's labelled test images (see the module docstring)."""
    from edge_client.bundle import Bundle
    from edge_client.engines import Candidate, offered, open_engine, unavailable
    from edge_client.runtime_choice import choose
    from export.bundle_writer import BundleOptions, ExportOptions, export_bundle

    export_bundle(run_path, out=work / "trained-fp32", options=ExportOptions(BundleOptions(training=False)))
    bundle = Bundle.open(work / "trained-fp32")
    pixels, labels = labelled_images(run_path, bundle, count)
    if not len(labels):
        return {"run": str(run_path), "images": 0, "note": "no labelled test image of the bundle's classes"}
    reference = logits(open_engine(bundle, Candidate("ort", bundle.precision), "cpu", threads), pixels)
    fp32 = float(np.mean(reference.argmax(-1) == labels))
    with fresh_verdicts():
        choice = choose(bundle, "auto", "auto", "cpu", threads)
    engines = {"auto": choice.engine or open_engine(bundle, choice.candidate, "cpu", threads)}
    if unavailable("openvino") is None and "bf16" in offered("openvino", bundle):
        engines["openvino_bf16"] = open_engine(bundle, Candidate("openvino", "bf16"), threads=threads)
    out: dict[str, Any] = {"run": str(run_path), "images": int(len(labels)), "fp32_accuracy": round(fp32, 6),
                           "check_images": bundle.manifest.get("check_images", {}).get("source")}
    for key, engine in engines.items():
        found = logits(engine, pixels)
        accuracy = float(np.mean(found.argmax(-1) == labels))
        out[key] = {"accuracy": round(accuracy, 6), "drop_points": round(100 * (fp32 - accuracy), 4),
                    "top1_agreement": round(float(np.mean(found.argmax(-1) == reference.argmax(-1))), 6),
                    "max_abs_logit_diff": float(f"{np.max(np.abs(found - reference)):.3e}")}
    out["auto"].update(runtime=choice.candidate.runtime, precision=choice.candidate.precision, how=choice.how,
                       line=choice.line.split("; cache ")[0])
    return out


def accuracy_ratios(trained: dict[str, Any] | None) -> dict[str, float | None]:
    """The section's ratios: each runtime's accuracy drop in points and its top-1 agreement with fp32."""
    out: dict[str, float | None] = {}
    for key in ("auto", "openvino_bf16"):
        held = (trained or {}).get(key) or {}
        out[f"{key}_accuracy_drop_points"] = held.get("drop_points")
        out[f"{key}_top1_agreement"] = held.get("top1_agreement")
    return out
