"""Helpers for the edge-client tests: a tiny run + bundle, local data, awkward image files.

(A module of its own, not `conftest`: another test directory has a conftest with helpers too.)
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ["red_circle", "blue_square", "green_triangle", "yellow_star", "purple_cross", "orange_ring"]
LORA = [f"lora.block.attn.to_{t}.lora_{p}.weight" for t in "qkv" for p in "AB"]
REPO = Path(__file__).resolve().parents[2]
SYNTHETIC = REPO / "fedmvp" / "weights" / "fedmvp-tiny-synthetic.safetensors"


def pretrained_tag() -> str:
    return "synthetic" if SYNTHETIC.is_file() else ""


def class_image(ci: int, rng: np.random.Generator, size: tuple[int, int] = (48, 40)) -> Image.Image:
    """Coloured noise whose dominant channel and brightness depend on the class index."""
    w, h = size
    pixels = (rng.random((h, w, 3)) * 120).astype(np.uint8)
    pixels[..., ci % 3] = 90 + 25 * ci
    return Image.fromarray(pixels)


def write_dataset(root: Path, per_class: int = 8) -> None:
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for ci, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                class_image(ci, rng).save(folder / f"{i:03d}.png")
    colour = {c: c.split("_")[0] for c in CLASSES}
    attrs = {c: [f"{colour[c]} colour", f"a {c.split('_')[1]} outline", "a flat surface"] for c in CLASSES}
    (root / "attributes.json").write_text(json.dumps(attrs))


def write_preset(path: Path, data_root: Path) -> None:
    path.write_text(f"""
name = "edgetest"
protocol = "base-to-new"
seed = 0
[model]
clip = "fedmvp-tiny"
pretrained = "{pretrained_tag()}"
[train]
rounds = 2
batch_size = 16
shots = 2
num_attributes = 3
[[datasets]]
name = "shapes"
layout = "imagefolder"
root = "{data_root}"
attributes = "attributes.json"
train_split = "train"
test_split = "test"
classes_per_client = 3
""")


def write_run(run_path: Path, preset: Path, seed: int = 0, moved: bool = False) -> None:
    """A run with rounds 1 and 2 whose LoRA B is non-zero (so LoRA changes the outputs);
    ``moved``: round 2's PromptFormer and LoRA differ from round 1's."""
    from tests.run_fixtures import write_run as shared

    shared(run_path, preset, pretrained_tag(), "edgetest", seed, moved=moved)


def rebuilt_model(run_path: Path, round_number: int = 2):
    """The PyTorch FedMVP model exactly as the exporter rebuilt it for the bundle."""
    from tests.run_fixtures import rebuilt_model as shared

    return shared(run_path, round_number)[0]


def write_local_data(root: Path, classes: list[str], per_class: int = 4, seed: int = 1) -> Path:
    """An ImageFolder tree for `edge-client train`."""
    rng = np.random.default_rng(seed)
    for name in classes:
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            class_image(CLASSES.index(name), rng).save(folder / f"img{i}.png")
    return root


def preprocess_batch(images: list[Image.Image], spec) -> np.ndarray:
    """Many PIL images -> the model's float32 input [N, 3, S, S] (N may be 0), as inference builds it."""
    from edge_client.preprocess import preprocess

    arrays = [preprocess(im, spec) for im in images]
    return np.stack(arrays) if arrays else np.zeros((0, 3, spec.image_size, spec.image_size), np.float32)


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by relative path (to prove a directory did not change)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---- awkward inputs ------------------------------------------------------------------------------------
def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _noise(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def write_awkward_files(root: Path) -> tuple[list[str], list[str]]:
    """(readable, unreadable) file names written into ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    good: list[str] = []
    bad: list[str] = []

    def ok(name: str) -> Path:
        good.append(name)
        return root / name

    def fail(name: str) -> Path:
        bad.append(name)
        return root / name

    _noise(40, 30, 1).save(ok("rgb.png"))
    Image.new("RGB", (1, 1), (200, 10, 10)).save(ok("one_pixel.png"))
    _noise(40, 30, 2).convert("L").save(ok("gray.png"))
    rgba = _noise(40, 30, 3).convert("RGBA")
    rgba.putalpha(128)
    rgba.save(ok("rgba.png"))
    _noise(40, 30, 4).convert("P", palette=Image.Palette.ADAPTIVE, colors=16).save(ok("palette.png"))
    Image.fromarray((np.random.default_rng(5).random((30, 40)) * 65535).astype(np.uint16)).save(ok("gray16.png"))
    frames = [Image.new("RGB", (24, 24), c) for c in [(255, 0, 0), (0, 255, 0), (0, 0, 255)]]
    frames[0].save(ok("animated.gif"), save_all=True, append_images=frames[1:], duration=50, loop=0)
    Image.new("CMYK", (32, 32), (0, 255, 255, 0)).save(ok("cmyk.jpg"), quality=95)
    upright = _noise(30, 50, 6)
    upright.save(ok("upright.png"))
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated; "rotate 90 clockwise to display" gives `upright` back
    upright.transpose(Image.Transpose.ROTATE_90).save(ok("exif_rotated.png"), exif=exif.tobytes())

    fail("empty.png").write_bytes(b"")
    fail("not_an_image.jpg").write_text("this is a text file, not a JPEG\n")
    raw = io.BytesIO()
    _noise(64, 64, 7).save(raw, format="PNG")
    data = raw.getvalue()
    fail("truncated.png").write_bytes(data[: len(data) // 2])
    corrupt = bytearray(data)
    corrupt[60:200] = bytes(140)
    fail("corrupt.png").write_bytes(bytes(corrupt))
    ihdr = struct.pack(">IIBBBBB", 60000, 60000, 8, 2, 0, 0, 0)  # 3.6 gigapixels claimed, no data
    fail("huge_header.png").write_bytes(b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IEND", b""))
    return good, bad
