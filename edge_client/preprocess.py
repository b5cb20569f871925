"""Image preprocessing in numpy/Pillow, bit-for-bit with open_clip's eval transform.

The bundle's manifest carries preprocessing as data, so the edge device needs no torch,
torchvision or open_clip. open_clip's eval transform for a square size is:
  Resize(size, BICUBIC) -> CenterCrop(size) -> convert("RGB") -> ToTensor -> Normalize.
torchvision resizes PIL images with PIL itself, so using the same PIL calls with the
same output sizes and crop boxes gives identical pixels; the float math is float32 as
in torch. The parity test in tests/edge_client checks this against open_clip.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)

_RESIZE_MODES = {
    "bicubic-shortest-side": Image.Resampling.BICUBIC,
    "bilinear-shortest-side": Image.Resampling.BILINEAR,
}
_CROP_MODES = ("center",)


@dataclass(frozen=True)
class PreprocessSpec:
    """What the model expects: square input size, resize/crop rule, normalisation."""

    image_size: int = 224
    mean: tuple[float, float, float] = OPENAI_MEAN
    std: tuple[float, float, float] = OPENAI_STD
    resize: str = "bicubic-shortest-side"
    crop: str = "center"

    def __post_init__(self) -> None:
        if not isinstance(self.image_size, int) or isinstance(self.image_size, bool) or self.image_size < 1:
            raise ValueError(f"image_size must be a positive int, got {self.image_size!r}")
        if self.resize not in _RESIZE_MODES:
            raise ValueError(f"unsupported resize {self.resize!r}; supported: {sorted(_RESIZE_MODES)}")
        if self.crop not in _CROP_MODES:
            raise ValueError(f"unsupported crop {self.crop!r}; supported: {list(_CROP_MODES)}")
        for name in ("mean", "std"):
            v = getattr(self, name)
            if len(v) != 3:
                raise ValueError(f"{name} must have 3 values (RGB), got {len(v)}")
            object.__setattr__(self, name, tuple(float(x) for x in v))
        if any(s <= 0 for s in self.std):
            raise ValueError(f"std values must be > 0, got {self.std}")

    @classmethod
    def from_manifest(cls, d: Mapping[str, Any]) -> PreprocessSpec:
        """Build from the manifest's preprocessing dict (or a manifest holding a
        'preprocess' dict). Unknown keys are ignored so newer manifests still load;
        a square `image_size` may also be given as [size, size]."""
        if isinstance(d.get("preprocess"), Mapping):
            d = d["preprocess"]
        if "image_size" not in d:
            raise ValueError("preprocessing spec has no 'image_size'")
        size = d["image_size"]
        if isinstance(size, (list, tuple)):
            if len(size) != 2 or size[0] != size[1]:
                raise ValueError(f"only square image_size is supported, got {list(size)}")
            size = size[0]
        kwargs: dict[str, Any] = {"image_size": size}
        for key in ("mean", "std", "resize", "crop"):
            if key in d:
                kwargs[key] = tuple(d[key]) if key in ("mean", "std") else d[key]
        return cls(**kwargs)

    def to_manifest(self) -> dict[str, Any]:
        """The inverse of `from_manifest` (plain JSON types)."""
        return {"image_size": self.image_size, "resize": self.resize, "crop": self.crop,
                "mean": list(self.mean), "std": list(self.std)}


def resized_size(width: int, height: int, size: int) -> tuple[int, int]:
    """(w, h) after a shorter-side resize, as torchvision's `_compute_resized_output_size`:
    the short side becomes `size`, the long side `int(size * long / short)` (truncated)."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    return (new_short, new_long) if width <= height else (new_long, new_short)


def resize_shorter_side(image: Image.Image, size: int, resample: int = Image.Resampling.BICUBIC) -> Image.Image:
    """torchvision `Resize(size)` on a PIL image: unchanged if already the right size."""
    new_w, new_h = resized_size(image.width, image.height, size)
    if (new_w, new_h) == image.size:
        return image
    return image.resize((new_w, new_h), resample)


def center_crop(image: Image.Image, size: int) -> Image.Image:
    """torchvision `CenterCrop(size)`: zero-pad if smaller, then crop at
    `int(round((h - th) / 2.0))` (Python's round-half-even, as torchvision).

    After a shorter-side resize to the same size no padding can occur; it is kept
    for callers that crop without resizing."""
    w, h = image.size
    if size > w or size > h:
        pad_l = (size - w) // 2 if size > w else 0
        pad_t = (size - h) // 2 if size > h else 0
        pad_r = (size - w + 1) // 2 if size > w else 0
        pad_b = (size - h + 1) // 2 if size > h else 0
        # Same call as torchvision's PIL pad (fill 0; palette re-attached for P images).
        padded = ImageOps.expand(image, border=(pad_l, pad_t, pad_r, pad_b), fill=0)
        if image.mode == "P":
            palette = image.getpalette()
            if palette is not None:
                padded.putpalette(palette)
        image = padded
        w, h = image.size
        if (w, h) == (size, size):
            return image
    top = int(round((h - size) / 2.0))
    left = int(round((w - size) / 2.0))
    return image.crop((left, top, left + size, top + size))


def resize_crop_rgb(image: Image.Image, spec: PreprocessSpec) -> np.ndarray:
    """One PIL image -> uint8 RGB array [size, size, 3]: resize and crop, not normalised.

    Steps run in open_clip's order (resize and crop in the image's own mode, then
    convert to RGB), so parity holds for any mode; `load_image` already gives RGB.
    Training keeps these uint8 pixels and normalises per batch on its device."""
    img = resize_shorter_side(image, spec.image_size, _RESIZE_MODES[spec.resize])
    img = center_crop(img, spec.image_size)
    if img.mode != "RGB":
        img = img.convert("RGB")
    return np.asarray(img, dtype=np.uint8)


def normalise(pixels: np.ndarray, spec: PreprocessSpec) -> np.ndarray:
    """uint8 RGB [..., size, size, 3] (resized and cropped) -> normalised float32 [..., 3, size, size]:
    ToTensor and Normalize, as torch computes them in float32."""
    x = pixels.astype(np.float32) / np.float32(255.0)
    mean = np.asarray(spec.mean, dtype=np.float32)
    std = np.asarray(spec.std, dtype=np.float32)
    x = (x - mean) / std
    return np.ascontiguousarray(np.moveaxis(x, -1, -3), dtype=np.float32)


def preprocess(image: Image.Image, spec: PreprocessSpec) -> np.ndarray:
    """One PIL image -> normalised float32 array [3, size, size] (the model's input)."""
    return normalise(resize_crop_rgb(image, spec), spec)
