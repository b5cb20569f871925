"""What a bundle refresh costs a device: the bytes of its round message, and the seconds it takes.

A device whose bundle holds an older global PromptFormer receives the round's ``promptformer.*``
and ``lora.*`` tensors (fp32) and refreshes the bundle in place (``edge_client.refresh``); a
device that is current needs only the ``lora.*`` tensors. Bytes per device for both messages,
for fedmvp-tiny and the real ViT-B-16 architecture (random init: sizes do not depend on the
weights; default FedMVPConfig). Then the wall time of refreshing a random-init fedmvp-tiny
bundle (16 classes, exported into a temporary directory), median of ``--repeats`` after one
warm-up, without and with the parity check on 4 images (ONNX Runtime against the training program).

    python benchmarks/edge_refresh.py
    python benchmarks/edge_refresh.py --json          # one JSON object on stdout
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.edge_infer import build_tiny_bundle, write_images  # noqa: E402
from edge_client.bundle import read_bundle  # noqa: E402
from edge_client.refresh import promptformer_digest, refresh_bundle  # noqa: E402
from fedmvp.clip import load_clip  # noqa: E402
from fedmvp.model import FedMVP  # noqa: E402

MODELS = ("fedmvp-tiny", "ViT-B-16")


def message_bytes(name: str) -> dict:
    """Bytes of the PromptFormer and LoRA tensors (fp32) of the default FedMVP on backbone ``name``."""
    torch.manual_seed(0)
    model = FedMVP(load_clip(name, None))
    promptformer = sum(v.numel() * 4 for v in model.state("promptformer").values())
    lora = sum(v.numel() * 4 for v in model.state("lora").values())
    return {"model": name, "promptformer_bytes": promptformer, "lora_bytes": lora,
            "refresh_message_bytes": promptformer + lora, "lora_only_message_bytes": lora,
            "ratio": (promptformer + lora) / lora}


def next_round(seed: int = 1) -> dict[str, np.ndarray]:
    """A later round's global tensors for the tiny bundle: its model's, moved by a little noise."""
    torch.manual_seed(0)
    model = FedMVP(load_clip("fedmvp-tiny", None))
    generator = torch.Generator().manual_seed(seed)
    return {k: (v + 0.01 * torch.randn(v.shape, generator=generator)).numpy()
            for k, v in model.state("all").items()}


def refresh_seconds(work: Path, repeats: int) -> dict:
    """Median seconds of refreshing a fresh copy of a tiny bundle, without and with 4 check images."""
    exported = build_tiny_bundle(work)
    images = write_images(work / "images", 4)
    tensors = next_round()
    digest = promptformer_digest(tensors)
    out: dict = {"bundle_bytes": sum(p.stat().st_size for p in exported.iterdir() if p.is_file())}
    for label, check in (("no_check_images", []), ("4_check_images", images)):
        times = []
        for attempt in range(repeats + 1):  # the first warms up (ONNX Runtime, the training program)
            copy = work / "copy"
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(exported, copy)
            start = time.perf_counter()
            refresh_bundle(read_bundle(copy), tensors, digest=digest, round_number=2, check_images=check)
            if attempt:
                times.append(time.perf_counter() - start)
        out[label] = statistics.median(times)
    return out


def show(messages: list[dict], timing: dict, repeats: int) -> None:
    print("round message per device (fp32 tensors):")
    print(f"  {'model':<12} {'promptformer.* + lora.*':>24} {'lora.* only':>12} {'ratio':>8}")
    for row in messages:
        print(f"  {row['model']:<12} {row['refresh_message_bytes'] / 1e6:21.3f} MB "
              f"{row['lora_only_message_bytes'] / 1e3:9.1f} KB {row['ratio']:7.1f}x")
    print(f"refresh of a fedmvp-tiny bundle ({timing['bundle_bytes'] / 1e6:.2f} MB, 16 classes), median of "
          f"{repeats}: {timing['no_check_images']:.3f} s without check images, "
          f"{timing['4_check_images']:.3f} s with 4")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the table")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger().setLevel(logging.ERROR)
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    messages = [message_bytes(name) for name in MODELS]
    with tempfile.TemporaryDirectory(prefix="fedmvp-edge-refresh-") as work:
        timing = refresh_seconds(Path(work), args.repeats)
    if args.json:
        print(json.dumps({"messages": messages, "refresh_seconds": timing, "repeats": args.repeats}, sort_keys=True))
    else:
        show(messages, timing, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
