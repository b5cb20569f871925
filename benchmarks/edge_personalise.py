"""On-device personalisation: held-out top-1 before and after `edge-client train`, per recipe and seed.

Takes a run (e.g. one `fedmvp demo` wrote), exports its last round, builds the demo's local folder
(8 training images per new class) and held-out folder (the new classes' test images), then trains
a fresh copy of the bundle with each recipe and seed and classifies the held-out folder (40-way over
every baked class, as `fedmvp demo` does).

    python benchmarks/edge_personalise.py --run runs/demo-X
    python benchmarks/edge_personalise.py --run runs/demo-X --seeds 0 1 2 --json results.json
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from edge_client.infer import infer_paths  # noqa: E402
from edge_client.train import train_local  # noqa: E402
from export.bundle_writer import export_bundle  # noqa: E402
from fedmvp_apps.cli.demo import EDGE_BATCH, EDGE_TRAIN, new_class_folders  # noqa: E402
from fedmvp.runs import RunDir  # noqa: E402
from fedmvp_formats.atomic import write_text  # noqa: E402

# name -> train_local keywords (epochs, lr, optimizer, alpha); the demo's own recipe comes last.
RECIPES = {
    "paper defaults (SGD 0.003, alpha 10, 5 epochs)": {"epochs": 5, "lr": 0.003, "optimizer": "sgd", "alpha": 10.0},
    "SGD 1.0, alpha 0, 20 epochs": {"epochs": 20, "lr": 1.0, "optimizer": "sgd", "alpha": 0.0},
    "AdamW 0.01, alpha 10, 20 epochs": {"epochs": 20, "lr": 0.01, "optimizer": "adamw", "alpha": 10.0},
    "demo: AdamW 0.01, alpha 1, 20 epochs": EDGE_TRAIN,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a run directory (its last round is exported)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.getLogger().setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    run = RunDir(args.run)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedmvp-personalise-") as work:
        work_path = Path(work)
        exported = export_bundle(run.path, out=work_path / "bundle")
        local, held_out, classes = new_class_folders(run, shots=8)
        before = infer_paths([str(held_out)], exported.path).accuracy()
        for name, recipe in RECIPES.items():
            for seed in args.seeds:
                copy = work_path / "copy"
                shutil.rmtree(copy, ignore_errors=True)
                shutil.copytree(exported.path, copy)
                result = train_local(str(local), copy, out=str(work_path / "updates"), batch_size=EDGE_BATCH, seed=seed,
                                     start="bundle", **recipe)
                after = infer_paths([str(held_out)], copy).accuracy()
                rows.append({"recipe": name, "seed": seed, "before": before, "after": after,
                             "loss_first": result.epoch_losses[0], "loss_last": result.epoch_losses[-1]})
    print(f"held-out images of {len(classes)} new classes, {rows[0]['before'] * 100:.2f}% top-1 before training")
    print(f"{'recipe':<48} {'seed':>4} {'loss':>17} {'after':>8}")
    for row in rows:
        print(f"{row['recipe']:<48} {row['seed']:>4} {row['loss_first']:8.3f} -> {row['loss_last']:5.3f} "
              f"{row['after'] * 100:7.2f}%")
    if args.json:
        write_text(args.json, json.dumps(rows, indent=2) + "\n")  # atomic: a reader never sees half of it
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
