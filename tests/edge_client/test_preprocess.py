"""edge_client.preprocess matches open_clip's eval transform to within 1e-5."""

from __future__ import annotations

import numpy as np
import pytest
from edge_helpers import preprocess_batch
from PIL import Image

from edge_client.preprocess import (
    PreprocessSpec,
    center_crop,
    preprocess,
    resized_size,
)

open_clip = pytest.importorskip("open_clip")
TF = pytest.importorskip("torchvision.transforms.functional")

MANIFEST = {
    "image_size": 224,
    "resize": "bicubic-shortest-side",
    "crop": "center",
    "mean": [0.48145466, 0.4578275, 0.40821073],
    "std": [0.26862954, 0.26130258, 0.27577711],
}

# (width, height): tiny, smaller than the crop, exact, portrait, landscape, extreme
# aspect ratios, odd/even differences that exercise the crop's rounding.
SIZES = [(1, 1), (2, 3), (7, 5), (31, 33), (32, 32), (33, 32), (100, 50), (50, 100),
         (223, 224), (224, 224), (225, 224), (224, 300), (300, 224), (640, 480),
         (480, 640), (1000, 3), (3, 1000), (517, 389), (1023, 767), (1920, 1080)]


def _rand_images(seed: int = 0, n_random: int = 10) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    sizes = SIZES + [tuple(int(v) for v in rng.integers(1, 900, 2)) for _ in range(n_random)]
    out = []
    for i, (w, h) in enumerate(sizes):
        if i % 3 == 0:  # smooth content (gradients) as well as noise
            yy, xx = np.mgrid[0:h, 0:w]
            a = np.stack([xx * 255 // max(w, 1), yy * 255 // max(h, 1), (xx + yy) % 256], -1)
            out.append(Image.fromarray(a.astype(np.uint8)))
        else:
            out.append(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))
    return out


@pytest.mark.parametrize("size", [224, 32])
def test_parity_with_open_clip(size):
    ref_tf = open_clip.image_transform(size, is_train=False)
    spec = PreprocessSpec.from_manifest({**MANIFEST, "image_size": size})
    worst = 0.0
    for im in _rand_images(seed=size):
        ours = preprocess(im, spec)
        ref = ref_tf(im).numpy()
        assert ours.shape == ref.shape == (3, size, size)
        assert ours.dtype == np.float32
        worst = max(worst, float(np.abs(ours - ref).max()))
    assert worst <= 1e-5, worst


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "CMYK"])
def test_parity_for_non_rgb_modes(mode):
    ref_tf = open_clip.image_transform(32, is_train=False)
    spec = PreprocessSpec(image_size=32)
    for im in _rand_images(seed=7, n_random=2)[:12]:
        im = im.convert(mode)
        assert float(np.abs(preprocess(im, spec) - ref_tf(im).numpy()).max()) <= 1e-5


def test_batch_matches_single_and_open_clip():
    ref_tf = open_clip.image_transform(32, is_train=False)
    spec = PreprocessSpec(image_size=32)
    ims = _rand_images(seed=3, n_random=0)[:6]
    batch = preprocess_batch(ims, spec)
    assert batch.shape == (6, 3, 32, 32) and batch.dtype == np.float32
    ref = np.stack([ref_tf(im).numpy() for im in ims])
    assert float(np.abs(batch - ref).max()) <= 1e-5
    assert preprocess_batch([], spec).shape == (0, 3, 32, 32)


def test_resized_size_matches_torchvision():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        h, w = (int(v) for v in rng.integers(1, 5000, 2))
        size = int(rng.choice([32, 224, 336]))
        new_h, new_w = TF._compute_resized_output_size((h, w), [size])
        assert resized_size(w, h, size) == (new_w, new_h)


@pytest.mark.parametrize("wh", [(5, 3), (3, 8), (40, 10), (10, 40), (31, 32), (33, 40), (7, 7)])
@pytest.mark.parametrize("mode", ["RGB", "L", "P"])
def test_center_crop_and_pad_match_torchvision(wh, mode):
    rng = np.random.default_rng(sum(wh))
    im = Image.fromarray(rng.integers(0, 256, (wh[1], wh[0], 3), dtype=np.uint8)).convert(mode)
    for size in (4, 8, 32):
        ours, ref = center_crop(im, size), TF.center_crop(im, [size])
        assert ours.size == ref.size == (size, size) and ours.mode == ref.mode
        assert np.array_equal(np.asarray(ours.convert("RGB")), np.asarray(ref.convert("RGB")))


def test_spec_from_manifest_and_validation():
    spec = PreprocessSpec.from_manifest(MANIFEST)
    assert spec.image_size == 224 and spec.mean == tuple(MANIFEST["mean"])
    assert PreprocessSpec.from_manifest(spec.to_manifest()) == spec
    assert PreprocessSpec.from_manifest({"preprocess": {**MANIFEST, "image_size": [32, 32]}}).image_size == 32
    assert PreprocessSpec.from_manifest({"image_size": 32, "future_key": 1}) == PreprocessSpec(image_size=32)
    bad = [{}, {**MANIFEST, "image_size": [32, 48]}, {**MANIFEST, "image_size": 0},
           {**MANIFEST, "resize": "lanczos"}, {**MANIFEST, "crop": "none"},
           {**MANIFEST, "mean": [0.5, 0.5]}, {**MANIFEST, "std": [0.2, 0.0, 0.2]}]
    for d in bad:
        with pytest.raises(ValueError):
            PreprocessSpec.from_manifest(d)
