"""The check before a refreshed bundle is committed: its ONNX model loads and agrees with its training program.

Why: a refresh rewrites tensors in place, trusting that the ONNX model reads them at the offsets
it was exported with and that the training program reads them by name. Running both on the staged
files catches a bundle where either assumption fails before the device uses it. Images are read
and preprocessed exactly as `edge-client infer` does; the tolerance is the exporter's fp32 one,
relative to the logits' size (the logit scale makes them large): max |diff| <= 1e-3 * max(1, max
|logit|) and the same top-1 class for every image. torch is imported only when images are given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.bundle import Bundle, BundleError
from edge_client.images import ImageReadError, load_image
from edge_client.preprocess import preprocess
from edge_client.runtime import make_session
from edge_client.safetensors_check import load_safetensors

MAX_IMAGES = 4
TOLERANCE = 1e-3


def check_refreshed(bundle: Bundle, onnx_path: Path, weights_path: Path, lora: Mapping[str, np.ndarray],
                    images: Sequence[Path]) -> tuple[float | None, int]:
    """(max |logit diff|, images compared) of the staged model; raises `BundleError` when they disagree."""
    try:
        session, _ = make_session(onnx_path, "cpu")
    except Exception as err:  # noqa: BLE001 - ORT raises several pybind types for a model it cannot load
        raise BundleError(f"{bundle.path}: the refreshed ONNX model does not load "
                          f"({' '.join(str(err).split())[:300]}); the bundle is unchanged") from None
    pixels = _pixels(bundle, images)
    input_name = bundle.manifest.get("onnx", {}).get("input", session.get_inputs()[0].name)
    if pixels is None:
        zeros = np.zeros((1, 3, bundle.preprocess.image_size, bundle.preprocess.image_size), np.float32)
        if not np.all(np.isfinite(session.run(["logits"], {input_name: zeros})[0])):
            raise BundleError(f"{bundle.path}: the refreshed ONNX model computes non-finite logits; unchanged")
        return None, 0
    onnx_logits = session.run(["logits"], {input_name: pixels})[0].astype(np.float64)
    program_logits = _program_logits(bundle, pixels, weights_path, lora)
    diff = float(np.abs(onnx_logits - program_logits).max())
    limit = TOLERANCE * max(1.0, float(np.abs(onnx_logits).max()))
    agreement = float(np.mean(onnx_logits.argmax(-1) == program_logits.argmax(-1)))
    if agreement < 1.0 or not diff <= limit:
        raise BundleError(f"{bundle.path}: after the refresh ONNX Runtime and the training program disagree on "
                          f"{len(pixels)} images (max |logit diff| {diff:.3e}, allowed {limit:.3e}; top-1 "
                          f"agreement {100 * agreement:.1f}%, need 100%); refused, the bundle is unchanged")
    return diff, len(pixels)


def _pixels(bundle: Bundle, images: Sequence[Path]) -> np.ndarray | None:
    """Up to `MAX_IMAGES` readable images, preprocessed as inference does (None when there are none)."""
    arrays = []
    for path in images:
        if len(arrays) == MAX_IMAGES:
            break
        try:
            arrays.append(preprocess(load_image(path), bundle.preprocess))
        except (ImageReadError, OSError, ValueError):
            continue  # an unreadable check image is skipped, not a reason to refuse the round
    return np.stack(arrays) if arrays else None


def _program_logits(bundle: Bundle, pixels: np.ndarray, weights_path: Path,
                    lora: Mapping[str, np.ndarray]) -> np.ndarray:
    """Logits of the bundle's training program fed the staged weights and ``lora``."""
    try:
        import torch
    except ImportError as err:
        raise BundleError(f"{bundle.path}: the parity check of a refresh needs torch ({err}); install "
                          f"fedmvp[edge-train] or pass no check images") from None
    from edge_client.program import load_runner

    runner = load_runner(bundle)[0]  # train.pt2, or the TorchScript module where this torch cannot load it
    weights: dict[str, Any] = dict(sorted(load_safetensors(weights_path, framework="pt").items()))
    tensors = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in sorted(lora.items())}
    x = torch.from_numpy(pixels)
    with torch.no_grad():
        _, logits, _ = runner(x, x, tensors, weights)
    return logits.double().numpy()
