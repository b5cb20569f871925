"""The C++ consumer's speed: ``examples/cpp``'s ``fedmvp_infer`` (libtorch, the bundle's TorchScript module)
against ONNX Runtime fp32 on the same bundle, same machine, same thread count, same run.

Both sides time only the model call on the bundle's check images (normalised, repeated to fill the
batch): ``fedmvp_infer --bench`` measures inside C++ after loading; ONNX Runtime is timed here around
``Predictor.run``. Median of ``repeats`` calls after two warm-up calls, in milliseconds per image.
Run: ``python -m benchmarks.edge_cpp --bundle DIR`` or ``--model fedmvp-tiny --work DIR`` (builds a
random-init bundle with the TorchScript module). How to read it: docs/howto/cpp-libtorch.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.cpp_build import build_binary


def _cpp_ms(binary: Path, bundle: Path, batch: int, repeats: int, threads: int) -> tuple[float, float]:
    """``fedmvp_infer --bench``'s median and fastest milliseconds per image."""
    proc = subprocess.run([str(binary), str(bundle), "--bench", str(repeats), "--batch", str(batch),
                           "--threads", str(threads)], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{binary}: --bench failed: {proc.stderr.strip()}")
    bench = json.loads(proc.stdout.strip().splitlines()[-1])["bench"]
    return float(bench["ms_per_image_median"]), float(bench["ms_per_image_min"])


def check_top1(binary: Path, bundle: Path, threads: int) -> list[int]:
    """The binary's top-1 class index per check image, in the bundle's check-image order (what the edge table
    compares with ONNX Runtime's image for image)."""
    proc = subprocess.run([str(binary), str(bundle), "--check-images", "--json", "--top", "1",
                           "--threads", str(threads)], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{binary}: --check-images failed: {proc.stderr.strip()}")
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return [int(line["top_k"][0]["index"]) for line in lines]


def _ort_ms(bundle: Path, batch_sizes: tuple[int, ...], repeats: int,
            threads: int) -> dict[int, tuple[float, float]]:
    """ONNX Runtime fp32 on the bundle (edge-client's Predictor, the bundle's LoRA): median and fastest
    ms per image."""
    import numpy as np

    from edge_client.bundle import read_bundle
    from edge_client.infer import Predictor
    from edge_client.runtime_choice import check_images

    opened = read_bundle(bundle)
    predictor = Predictor(opened, personalised=False, runtime="ort", precision="fp32", threads=threads)
    pixels = check_images(opened)
    out: dict[int, tuple[float, float]] = {}
    for batch in batch_sizes:
        x = np.ascontiguousarray(pixels[np.arange(batch) % len(pixels)])
        for _ in range(2):
            predictor.run(x)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            predictor.run(x)
            times.append((time.perf_counter() - start) * 1000 / batch)
        out[batch] = (statistics.median(times), min(times))
    return out


def cpp_ms_per_image(bundle: Path, batch_sizes: tuple[int, ...] = (1, 8), repeats: int = 20,
                     threads: int | None = None, binary: Path | None = None) -> dict[str, Any]:
    """``{"cpp": {batch: ms}, "ort_fp32": {batch: ms}, "cpp_over_ort": {batch: ratio}, "top1": [...], ...}``:
    the binary's top-1 per check image, and median ms per
    image of the libtorch binary and of ONNX Runtime fp32 (``*_min``: the fastest call, what a loaded
    machine distorts least), both on ``threads`` threads (all cores by default).
    Builds the binary unless given (cached per source: benchmarks/cpp_build.py)."""
    threads = threads or os.cpu_count() or 1
    build_seconds = 0.0
    if binary is None:
        binary, build_seconds = build_binary()
    cpp = {b: _cpp_ms(binary, Path(bundle), b, repeats, threads) for b in batch_sizes}
    ort = _ort_ms(Path(bundle), tuple(batch_sizes), repeats, threads)
    out: dict[str, Any] = {"bundle": str(bundle), "threads": threads, "repeats": repeats,
                           "build_seconds": round(build_seconds, 1),
                           "top1": check_top1(binary, Path(bundle), threads)}
    for key, pick in (("", 0), ("_min", 1)):
        out[f"cpp{key}"] = {b: round(cpp[b][pick], 3) for b in batch_sizes}
        out[f"ort_fp32{key}"] = {b: round(ort[b][pick], 3) for b in batch_sizes}
        out[f"cpp_over_ort{key}"] = {b: round(cpp[b][pick] / ort[b][pick], 2) for b in batch_sizes}
    return out


def torchscript_bundle(work: Path, name: str, classes: int = 10, attributes: int = 4) -> Path:
    """A random-init ``name`` bundle with ``model.torchscript.pt`` (no training artifact): speed does not
    depend on the weights (benchmarks/edge_models.py)."""
    from benchmarks.edge_models import class_set, load_backbone
    from export.bundle_writer import BundleInputs, BundleOptions, write_bundle
    from export.parity import MIN_IMAGES
    from export.run_inputs import synthetic_images
    from fedmvp.model import FedMVP

    clip = load_backbone(name, "synthetic" if name == "fedmvp-tiny" else None)
    out = work / f"bundle-{name}-torchscript"
    write_bundle(FedMVP(clip), clip, class_set(classes, attributes), out,
                 BundleInputs(synthetic_images(MIN_IMAGES, clip.image_size)),
                 BundleOptions(training=False, torchscript=True))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--bundle", type=Path, help="a bundle exported with --format torchscript")
    where.add_argument("--model", help="build a random-init bundle of this CLIP (fedmvp-tiny, ViT-B-16) in --work")
    parser.add_argument("--work", type=Path, default=Path("bench-cpp"))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    bundle = args.bundle
    if bundle is None:
        start = time.perf_counter()
        bundle = torchscript_bundle(args.work, args.model)
        print(f"built {bundle} in {time.perf_counter() - start:.1f} s", flush=True)
    print(json.dumps(cpp_ms_per_image(bundle, tuple(args.batch), args.repeats, args.threads)))


if __name__ == "__main__":
    main()
