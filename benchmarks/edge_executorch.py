"""ExecuTorch beside ONNX Runtime fp32 on one bundle: ms per image at batch 1 and 8, timed interleaved.

Why apart from benchmarks/edge.py: executorch is an optional extra (docs/howto/executorch.md) and its
export is slow, so its rows are measured on a bundle that already carries ``model.pte``
(`fedmvp-export --format executorch`, or ``executorch_bundle`` here for a random-init backbone). Both
engines are the device's own (`edge_client.engines.open_engine`), fed the bundle's check images tiled
to the batch, in one process, round-robin (``benchmarks.common.interleaved_medians``).

    python -m benchmarks.edge_executorch BUNDLE [--repeats 20]
    python -m benchmarks.edge_executorch --model fedmvp-tiny     # builds a random-init bundle first
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import interleaved_medians, set_threads


def executorch_bundle(work: Path, name: str, classes: int = 10, attributes: int = 4) -> Path:
    """A random-init ``name`` bundle carrying model.pte (speed does not depend on the weights)."""
    from benchmarks.edge_models import class_set, load_backbone
    from export.bundle_writer import BundleInputs, BundleOptions, write_bundle
    from export.parity import MIN_IMAGES
    from export.run_inputs import synthetic_images
    from fedmvp.model import FedMVP

    clip = load_backbone(name, "synthetic" if name == "fedmvp-tiny" else None)
    out = work / f"bundle-{name}-executorch"
    write_bundle(FedMVP(clip), clip, class_set(classes, attributes), out,
                 BundleInputs(synthetic_images(MIN_IMAGES, clip.image_size)),
                 BundleOptions(training=False, executorch=True))
    return out


def executorch_rows(bundle: Path, batches: tuple[int, ...] = (1, 8), repeats: int = 20,
                    threads: int | None = None) -> dict[str, Any]:
    """ms/image of ``executorch`` and ``ort_fp32`` per batch, their ratio, and top-1 agreement on the
    check images; ``{"skipped": why}`` where executorch is missing or the bundle has no model.pte."""
    if importlib.util.find_spec("executorch") is None:
        return {"skipped": "executorch is not installed (pip install 'fedmvp[executorch]')"}
    from edge_client.bundle import read_bundle
    from edge_client.engines import Candidate, open_engine
    from edge_client.executorch_runtime import not_offered
    from edge_client.runtime_choice import check_images

    opened = read_bundle(bundle)
    why = not_offered(opened)
    if why is not None:
        return {"skipped": why}
    count = set_threads(threads)
    engines = {"executorch": open_engine(opened, Candidate("executorch", "fp32"), "cpu", count),
               "ort_fp32": open_engine(opened, Candidate("ort", opened.precision), "cpu", count)}
    pixels = check_images(opened).astype(np.float32)
    logits = {name: engine.run({next(iter(engine.inputs)): pixels})[engine.outputs.index("logits")]
              for name, engine in engines.items()}
    out: dict[str, Any] = {"bundle": str(bundle), "threads": count, "repeats": repeats,
                           "check_images": len(pixels),
                           "top1_agreement": float((logits["executorch"].argmax(-1) ==
                                                    logits["ort_fp32"].argmax(-1)).mean()),
                           "max_abs_logit_diff": float(np.max(np.abs(logits["executorch"] - logits["ort_fp32"])))}
    for batch in batches:
        feed = np.ascontiguousarray(np.resize(pixels, (batch, *pixels.shape[1:])))
        fns = {name: (lambda e=engine: e.run({next(iter(e.inputs)): feed})) for name, engine in engines.items()}
        medians = interleaved_medians(fns, repeats)
        for name, seconds in medians.items():
            out[f"{name}_b{batch}_ms_per_image"] = round(1000 * seconds / batch, 3)
        out[f"executorch_vs_ort_fp32_b{batch}"] = round(medians["executorch"] / medians["ort_fp32"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("bundle", nargs="?", type=Path, help="a bundle with model.pte")
    parser.add_argument("--model", default=None, help="build a random-init bundle of this backbone instead")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if (args.bundle is None) == (args.model is None):
        parser.error("give a BUNDLE or --model")
    with tempfile.TemporaryDirectory(prefix="fedmvp-bench-et-") as work:
        bundle = args.bundle or executorch_bundle(Path(work), args.model)
        print(json.dumps(executorch_rows(bundle, repeats=args.repeats, threads=args.threads), sort_keys=True))


if __name__ == "__main__":
    main()
