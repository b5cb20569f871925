"""Edge bundle file sizes and parity per precision, for the tiny model and (optionally) ViT-B-16.

fedmvp-tiny uses the shipped synthetic weights (when present) on the synthetic world's 64
classes and test images, so its fp16/int8 agreement means something. ViT-B-16 is random
init over made-up classes and noise images: its sizes are real, its max |logit diff| shows
the arithmetic, but its top-1 agreement is not meaningful (the logits are nearly tied).
Writes bundles into a temporary directory.

    python benchmarks/export_sizes.py                       # fedmvp-tiny, fp32 fp16 int8
    python benchmarks/export_sizes.py --vit-b16             # also ViT-B-16 (a few minutes on 2 cores)
    python benchmarks/export_sizes.py --precisions fp32 --json sizes.json
    python benchmarks/export_sizes.py --run runs/demo-X --images 256   # a trained run, as fedmvp-export does
    python benchmarks/export_sizes.py --run runs/demo-X --inference-only
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from export.bundle_writer import BundleInputs, BundleOptions, write_bundle  # noqa: E402
from export.class_set import ClassSet  # noqa: E402
from export.run_inputs import synthetic_images  # noqa: E402
from fedmvp.clip import load_clip  # noqa: E402
from fedmvp.model import FedMVP  # noqa: E402
from fedmvp_formats.atomic import write_text  # noqa: E402

PHRASES = ["a round outline", "a striped surface", "a bright colour", "a long tail", "sharp corners",
           "a smooth texture", "four legs", "a pointed top", "a shiny finish", "small spots"]


def classes(count: int, k: int = 10) -> ClassSet:
    names = [f"class_{i:03d}" for i in range(count)]
    return ClassSet(names=names, attributes={n: [f"{p} {i}" for p in PHRASES[:k]] for i, n in enumerate(names)},
                    source="benchmark")


def world_inputs(clip, work: Path) -> tuple[ClassSet, torch.Tensor]:
    """The synthetic world's 64 classes (their attribute file) and its photo test images (2 per class)."""
    from PIL import Image

    from fedmvp.attributes.files import load_attributes
    from fedmvp.synthetic.writer import write_world

    root = write_world(work / "world", seed=0, counts={"test": 2}, domains=["photo"], workers=1)
    attributes = load_attributes(root / "attributes.json", k=10)
    images = []
    for path in sorted((root / "photo" / "test").glob("*/*.png")):
        with Image.open(path) as image:
            images.append(clip.preprocess(image.convert("RGB")))
    return ClassSet(names=list(attributes), attributes=attributes, source="synthetic world"), torch.stack(images)


def bundle_sizes(name: str, precisions: list[str], num_classes: int, images: int, work: Path,
                 training: bool = True) -> list[dict]:
    torch.manual_seed(0)
    shipped = name == "fedmvp-tiny" and (REPO / "fedmvp" / "weights" / "fedmvp-tiny-synthetic.safetensors").is_file()
    clip = load_clip(name, "synthetic" if shipped else None)
    model = FedMVP(clip)
    generator = torch.Generator().manual_seed(1)
    model.load_state({k: torch.randn(v.shape, generator=generator) * 0.02
                      for k, v in model.state("lora").items() if "lora_B" in k})
    if shipped:
        class_set, pixels = world_inputs(clip, work)
    else:
        class_set, pixels = classes(num_classes), synthetic_images(images, clip.image_size)
    rows = []
    for precision in precisions:
        start = time.perf_counter()
        result = write_bundle(model, clip, class_set, work / f"{name}-{precision}", BundleInputs(pixels),
                              BundleOptions(precision=precision, training=training))
        rows.append(row(name, "synthetic" if shipped else "random init", precision, result, start))
    return rows


def run_sizes(run: Path, precisions: list[str], images: int, work: Path, training: bool = True) -> list[dict]:
    """A trained run's last round, exported as `fedmvp-export` does (int8 calibrated on training images)."""
    from export.bundle_writer import BundleOptions, ExportOptions, export_bundle

    rows = []
    for precision in precisions:
        start = time.perf_counter()
        options = ExportOptions(BundleOptions(precision=precision, training=training), parity_images=images)
        result = export_bundle(run, out=work / f"run-{precision}", options=options)
        rows.append(row(result.manifest["model"]["clip"], f"run {run.name} round {result.manifest['source']['round']}",
                        precision, result, start))
    return rows


def row(model: str, weights: str, precision: str, result, start: float) -> dict:
    return {"model": model, "weights": weights, "precision": precision,
            "classes": result.manifest["classes"]["count"], "seconds": time.perf_counter() - start,
            "sizes": result.sizes, "total_bytes": result.total_bytes,
            "parity": {k: r.to_manifest() for k, r in result.parity.items()},
            "int8": result.int8.to_manifest() if result.int8 else None}


def show(rows: list[dict]) -> None:
    for row in rows:
        print(f"{row['model']} ({row['weights']}) {row['precision']} ({row['classes']} classes, "
              f"export {row['seconds']:.0f} s): "
              f"total {row['total_bytes'] / 1e6:.2f} MB")
        for file, size in sorted(row["sizes"].items()):
            print(f"    {file:<22}{size / 1e6:12.3f} MB")
        for precision, p in row["parity"].items():
            print(f"    parity {precision}: max |logit diff| {p['max_abs_logit_diff']:.2e}, "
                  f"top-1 agreement {100 * p['top1_agreement']:.2f}% over {p['images']} images")
        if row.get("int8"):
            plan = row["int8"]
            print(f"    int8 layers: {len(plan['quantized'])} quantised, {len(plan['kept_fp32'])} kept fp32 "
                  f"(calibration agreement {100 * plan['calibration_agreement']:.2f}%, expected "
                  f"{100 * plan['calibration_expected_agreement']:.2f}%, over "
                  f"{plan['calibration_images']} images)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vit-b16", action="store_true", help="also export a random-init ViT-B-16")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "fp16", "int8"])
    parser.add_argument("--classes", type=int, default=64)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--inference-only", action="store_true", help="bundles without the training files")
    parser.add_argument("--run", type=Path, default=None, help="export this trained run's last round instead")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger().setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedmvp-export-sizes-") as work:
        if args.run:
            rows += run_sizes(args.run, args.precisions, args.images, Path(work), not args.inference_only)
        for name in ([] if args.run else ["fedmvp-tiny"]) + (["ViT-B-16"] if args.vit_b16 else []):
            images = args.images if name == "fedmvp-tiny" else max(32, args.images // 2)
            rows += bundle_sizes(name, args.precisions, args.classes, images, Path(work), not args.inference_only)
    show(rows)
    if args.json:
        write_text(args.json, json.dumps(rows, indent=2, sort_keys=True) + "\n")  # atomic
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
