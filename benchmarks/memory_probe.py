"""Peak resident memory of one runtime, measured in a fresh process (peaks never go down in a process).

``python -m benchmarks.memory_probe RUNTIME ...`` loads one model (an ONNX file in ONNX Runtime, or
the PyTorch model built from its architecture: weights do not change memory), runs one batch and
prints ``{"peak_rss_mb", "baseline_mb"}``: the process's peak and its size after imports, before
the model (so the difference is the runtime's own cost)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.common import REPO, current_rss_mb, peak_rss_mb


def probe_onnx(path: Path, batch: int, image_size: int, threads: int, provider: str) -> None:
    import numpy as np  # noqa: F401

    from edge_client.runtime import make_session

    baseline = current_rss_mb()
    session, _ = make_session(path, provider=provider, threads=threads)
    pixels = np.zeros((batch, 3, image_size, image_size), np.float32)
    session.run(None, {session.get_inputs()[0].name: pixels})
    _report(baseline)


def probe_torch(kind: str, model: str, pretrained: str | None, classes: int, attributes: int, batch: int,
                threads: int) -> None:
    import torch

    from fedmvp.clip import load_clip
    from fedmvp.model import FedMVP

    torch.set_num_threads(threads)
    baseline = current_rss_mb()
    clip = load_clip(model, pretrained)
    net = FedMVP(clip).eval()
    net.set_text_features(torch.nn.functional.normalize(torch.randn(classes, attributes, clip.embed_dim), dim=-1))
    pixels = torch.zeros(batch, 3, clip.image_size, clip.image_size)
    with torch.inference_mode():
        (clip.model.visual if kind == "torch_plain" else net)(pixels)
    _report(baseline)


def _report(baseline: float) -> None:
    print(json.dumps({"peak_rss_mb": round(peak_rss_mb(), 1), "baseline_mb": round(baseline, 1)}))


def measure_all(models, work: Path, threads: int, batch: int, provider: str) -> dict[str, dict]:
    """``{runtime: {"peak_rss_mb", "baseline_mb"}}``, one fresh process per runtime."""
    jobs = {key: ["onnx", str(path)] for key, path in models.onnx.items()}
    pretrained = "synthetic" if models.name == "fedmvp-tiny" else ""
    for kind in ("torch_plain", "torch_prompted"):
        jobs[kind] = [kind, models.name, pretrained, str(models.classes), str(models.attributes)]
    out = {}
    for key, args in jobs.items():
        cmd = [sys.executable, "-m", "benchmarks.memory_probe", *args, "--batch", str(batch),
               "--image-size", str(models.image_size), "--threads", str(threads), "--provider", provider]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        out[key] = json.loads(lines[-1]) if done.returncode == 0 and lines else \
            {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["onnx", "torch_plain", "torch_prompted"])
    parser.add_argument("args", nargs="*", help="onnx: PATH; torch_*: MODEL PRETRAINED CLASSES ATTRIBUTES")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--provider", default="cpu")
    a = parser.parse_args(argv)
    if a.kind == "onnx":
        probe_onnx(Path(a.args[0]), a.batch, a.image_size, a.threads, a.provider)
    else:
        model, pretrained, classes, attributes = a.args
        probe_torch(a.kind, model, pretrained or None, int(classes), int(attributes), a.batch, a.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
