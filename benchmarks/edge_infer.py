"""Edge inference speed: images/s and latency per image at batch sizes 1, 8 and 32 (ONNX Runtime).

Two measurements per batch size, each the median over ``--repeats`` runs:
  model      ``session.run`` on already preprocessed batches (the ONNX model alone);
  end-to-end ``Predictor.infer`` on PNG files (decode + preprocess in numpy/Pillow + model).
Latency per image = batch wall time / batch size. Without ``--bundle`` a tiny bundle
(``fedmvp-tiny``, 16 classes, fp32) is exported into a temporary directory first.

    python benchmarks/edge_infer.py                       # tiny bundle, CPU provider
    python benchmarks/edge_infer.py --bundle DIR --provider auto --threads 4
    python benchmarks/edge_infer.py --json                # one JSON object on stdout
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from edge_client.infer import Predictor  # noqa: E402


def build_tiny_bundle(work: Path, num_classes: int = 16) -> Path:
    """Export a fedmvp-tiny bundle over ``num_classes`` made-up classes (needs the training extras)."""
    from benchmarks.edge_models import random_bundle

    return random_bundle(work, "fedmvp-tiny", num_classes, 3)


def write_images(folder: Path, count: int, size: tuple[int, int] = (320, 240)) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for i in range(count):
        path = folder / f"img{i:04d}.png"
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def bench(predictor: Predictor, files: list[Path], batch: int, repeats: int, min_images: int) -> dict:
    size = predictor.spec.image_size
    count = max(batch, (min_images // batch) * batch)
    pixels = np.random.default_rng(1).standard_normal((batch, 3, size, size)).astype(np.float32)
    predictor.run(pixels)  # warm-up
    model_times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(count // batch):
            predictor.run(pixels)
        model_times.append((time.perf_counter() - start) / count)
    files = (files * (count // len(files) + 1))[:count]
    e2e_times = []
    predictor.infer(files[:batch], batch_size=batch)  # warm-up
    for _ in range(repeats):
        start = time.perf_counter()
        result = predictor.infer(files, batch_size=batch)
        e2e_times.append((time.perf_counter() - start) / len(result.predictions))
    model, e2e = statistics.median(model_times), statistics.median(e2e_times)
    return {"batch_size": batch, "images_per_run": count, "repeats": repeats,
            "model_ms_per_image": 1000 * model, "model_images_per_s": 1 / model,
            "e2e_ms_per_image": 1000 * e2e, "e2e_images_per_s": 1 / e2e}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, default=None, help="bundle directory (default: export a tiny one)")
    parser.add_argument("--provider", default="cpu", help="auto | cpu | cuda | tensorrt (default cpu)")
    parser.add_argument("--threads", type=int, default=None, help="ORT intra-op threads (default: all allowed)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--min-images", type=int, default=64, help="images per run (rounded to the batch size)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    logging.getLogger().setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory(prefix="fedmvp-edge-bench-") as tmp:
        work = Path(tmp)
        bundle = args.bundle or build_tiny_bundle(work)
        predictor = Predictor(bundle, provider=args.provider, threads=args.threads)
        files = write_images(work / "images", 32)
        rows = [bench(predictor, files, b, args.repeats, args.min_images) for b in args.batch_sizes]
        meta = {"bundle": str(args.bundle or "tiny (fedmvp-tiny, temporary)"), "provider": predictor.provider,
                "image_size": predictor.spec.image_size, "classes": len(predictor.classes),
                "precision": predictor.bundle.precision, "threads": args.threads}
    if args.json:
        print(json.dumps({**meta, "rows": rows}, sort_keys=True))
        return 0
    print(f"bundle {meta['bundle']}: {meta['classes']} classes, {meta['image_size']} px, {meta['precision']}, "
          f"provider {meta['provider']}; medians of {args.repeats} runs")
    print(f"{'batch':>5}  {'model ms/img':>12}  {'model img/s':>11}  {'e2e ms/img':>10}  {'e2e img/s':>9}")
    for r in rows:
        print(f"{r['batch_size']:>5}  {r['model_ms_per_image']:>12.3f}  {r['model_images_per_s']:>11.1f}  "
              f"{r['e2e_ms_per_image']:>10.3f}  {r['e2e_images_per_s']:>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
