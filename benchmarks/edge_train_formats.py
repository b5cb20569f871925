"""The device's LoRA training step through train.pt2 and through train.torchscript.pt: milliseconds per step.

Why: where train.pt2 does not load, `edge-client train` trains through the TorchScript training module
(docs/howto/torchscript.md); this says what that costs. One step is what ``edge_client.train_run`` does:
forward through the program, the FedMVP objective (``fedmvp_formats.objective``, the bundle's alpha),
backward to the LoRA, one SGD step. Both programs get the same inputs and their own LoRA copy and
optimiser; ``benchmarks.common.interleaved_medians`` runs them round-robin (a noisy neighbour hits both
alike), after warm-up steps (TorchScript's profiling executor optimises its graph on the first calls).
CPU, fp32, no checkpointing (the CPU default), on a bundle exported with ``--format torchscript``.

    python -m benchmarks.edge_train_formats                               # fedmvp-tiny, batch 8
    python -m benchmarks.edge_train_formats --model ViT-B-16 --batch 2 --repeats 3
    python -m benchmarks.edge_train_formats --bundle BUNDLE --json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WARMUP = 3  # TorchScript profiles its first runs, then runs an optimised graph


def _stepper(torch: Any, runner: Any, lora: dict[str, Any], weights: dict[str, Any], x: Any, view: Any,
             labels: Any, alpha: float) -> Any:
    """One LoRA step through ``runner`` on its own copy of ``lora`` (forward, loss, backward, SGD step)."""
    import torch.nn.functional as functional

    from fedmvp_formats.objective import fedmvp_objective

    own = {k: v.detach().clone().requires_grad_(True) for k, v in lora.items()}
    opt = torch.optim.SGD(list(own.values()), lr=1e-3, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        features, logits, frozen = runner(x, view, own, weights)
        fedmvp_objective(features, logits, frozen, labels, alpha, functional)["loss"].backward()
        opt.step()

    return step


def train_step_rows(bundle: Path, batch: int, repeats: int) -> dict:
    """Median ms per LoRA step through train.pt2 and train.torchscript.pt on ``bundle`` at ``batch`` images,
    ``repeats`` interleaved steps each; ``ratio`` is torchscript / pt2 (above 1: TorchScript is slower)."""
    import numpy as np
    import torch

    from benchmarks.common import interleaved_medians
    from edge_client.bundle import read_bundle
    from edge_client.program import load_program
    from edge_client.safetensors_check import load_safetensors
    from edge_client.torchscript_training import load_script_runner

    b = read_bundle(bundle)
    size = int(b.preprocess.image_size)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, size, size, generator=gen)
    labels = torch.arange(batch) % len(b.class_names)
    weights = dict(sorted(load_safetensors(b.file("weights"), framework="pt").items()))
    lora = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in sorted(b.lora().items())}
    alpha = float(b.method["alpha"])
    steps = {name: _stepper(torch, runner, lora, weights, x, x.flip(-1), labels, alpha)
             for name, runner in (("pt2", load_program(b)), ("torchscript", load_script_runner(b)))}
    seconds = interleaved_medians(steps, repeats, warmup=WARMUP)
    pt2, ts = seconds["pt2"] * 1e3, seconds["torchscript"] * 1e3
    return {"bundle": str(bundle), "batch": batch, "repeats": repeats, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "pt2_ms": round(pt2, 2), "torchscript_ms": round(ts, 2),
            "ratio": round(ts / pt2, 3)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, help="a bundle exported with --format torchscript (default: "
                                                    "a random-init one of --model, built in a temp folder)")
    parser.add_argument("--model", default="fedmvp-tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        bundle = args.bundle
        if bundle is None:
            from benchmarks.edge_models import random_bundle

            bundle = random_bundle(Path(work), args.model, classes=10, attributes=4, torchscript=True)
        row = train_step_rows(bundle, args.batch, args.repeats)
    if args.json:
        print(json.dumps(row, sort_keys=True))
    else:
        print(f"LoRA step, batch {row['batch']}, {row['threads']} threads, torch {row['torch']}: train.pt2 "
              f"{row['pt2_ms']:.1f} ms, train.torchscript.pt {row['torchscript_ms']:.1f} ms "
              f"(ratio {row['ratio']:.2f})")


if __name__ == "__main__":
    main()
