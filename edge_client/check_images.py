"""The bundle's check images: the pictures `edge-client --runtime auto` verifies a runtime on.

Why real pictures: a runtime at reduced precision is judged by top-1 agreement with the bundle's fp32
(docs/architecture.md, "Runtimes"); on synthetic colour fields the logits are near-tied, so agreement
there says little about what a device sees. The exporter therefore ships the first images its parity
check used (``--images``, else the run's recorded test images) as ``check_images.safetensors`` (role
``check``, manifest section ``check_images``: ``fedmvp_formats.bundle_manifest`` holds the names). The
file holds one uint8 tensor [N, S, S, 3]: RGB after the bundle's resize and crop, before normalisation,
so the device normalises it exactly as it does a file (``preprocess.normalise``); uint8 is 4x smaller
than the float32 input and loses nothing (ToTensor divides uint8 by 255). ``--no-check-images`` (or an
export without real images) ships generated colour fields instead, and a bundle exported before check
images travelled has no file: the device generates the same kind of fields from the bundle id.

One writer (`write_check_images`, the exporter's) and one reader (`read_check_images`, header checked
first: one U8 tensor of that shape; a bad file is one `BundleError` line naming it). numpy, safetensors
and Pillow only: the inference install reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from fedmvp_formats.bundle_manifest import CHECK_TENSOR, MAX_CHECK_IMAGES

from edge_client.bundle_files import fail
from edge_client.preprocess import PreprocessSpec, normalise
from edge_client.safetensors_check import CHECK_ITEMSIZE, check_safetensors, load_safetensors

CHECK_COUNT = 32  # what the exporter ships and a device generates: export's parity minimum (export/parity.py)
SOURCE_WORDS = {"run-test": "the run's test images", "images": "the exporter's --images pictures",
                "generated": "colour fields generated at export",
                "bundle-id": "colour fields drawn from the bundle id"}  # bundle-id: a bundle that ships none


def check_words(source: str | None) -> str:
    """Where a bundle's check images came from, in words (the manifest's source, or "bundle-id")."""
    return SOURCE_WORDS.get(source or "bundle-id", str(source))


@dataclass(frozen=True)
class CheckImages:
    """Normalised check images [N, 3, S, S] and where they came from (a manifest source, or "bundle-id")."""

    pixels: np.ndarray
    source: str
    sha256: str | None = None  # the shipped file's (None: generated on the device)


def colour_fields(seed: int, count: int, size: int) -> np.ndarray:
    """``count`` smooth colour fields, uint8 [count, size, size, 3]: 8x8 random colours upsampled bicubically,
    so neighbouring pixels correlate as in photographs. The same ``seed`` gives the same pictures."""
    rng = np.random.default_rng(seed)
    fields = []
    for _ in range(count):
        low = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
        fields.append(np.asarray(Image.fromarray(low, "RGB").resize((size, size), Image.Resampling.BICUBIC)))
    return np.stack(fields).astype(np.uint8)


def id_seed(bundle_id: str) -> int:
    """The seed a device draws a bundle's colour fields from when the bundle ships none: its id's first 64 bits."""
    return int(bundle_id[:16], 16)


def write_check_images(path: Path, pixels: np.ndarray) -> None:
    """Write uint8 [N, S, S, 3] pictures as the check file (one metadata key: reproducible bytes)."""
    from safetensors.numpy import save_file

    if pixels.dtype != np.uint8 or pixels.ndim != 4 or pixels.shape[-1] != 3 or pixels.shape[1] != pixels.shape[2]:
        raise ValueError(f"check images must be uint8 [N, S, S, 3], got {pixels.dtype} {list(pixels.shape)}")
    save_file({CHECK_TENSOR: np.ascontiguousarray(pixels)}, str(path), metadata={"format": "np"})


def check_header(path: Path, size: int, count: int | None = None) -> None:
    """The check file's header: exactly one U8 tensor CHECK_TENSOR of shape [N, size, size, 3] (N = ``count``
    where the manifest says, and at most MAX_CHECK_IMAGES). uint8 pixels are finite by their type."""
    spans = check_safetensors(path, dtypes=CHECK_ITEMSIZE)
    if set(spans) != {CHECK_TENSOR}:
        raise fail(path, f"check images: holds tensors {sorted(spans)[:4]}, not the one tensor {CHECK_TENSOR!r}")
    shape = spans[CHECK_TENSOR].shape
    n = shape[0] if shape else 0
    if len(shape) != 4 or shape[1:] != (size, size, 3) or not 0 < n <= MAX_CHECK_IMAGES \
            or (count is not None and n != count):
        want = f"[{count if count is not None else 'N'}, {size}, {size}, 3]"
        raise fail(path, f"check images: shape {list(shape)} is not {want} (uint8 RGB at the bundle's image size)")


def read_check_images(path: Path, spec: PreprocessSpec, count: int | None = None) -> np.ndarray:
    """The shipped pictures, header checked first, normalised as `infer` normalises a file: [N, 3, S, S]."""
    check_header(path, spec.image_size, count)
    return normalise(load_safetensors(path, dtypes=CHECK_ITEMSIZE)[CHECK_TENSOR], spec)


def generated_check_images(bundle_id: str, spec: PreprocessSpec, count: int = CHECK_COUNT) -> np.ndarray:
    """A bundle without shipped check images: colour fields drawn from its id, normalised: [count, 3, S, S]."""
    return normalise(colour_fields(id_seed(bundle_id), count, spec.image_size), spec)
