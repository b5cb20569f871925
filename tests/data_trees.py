"""Tiny on-disk data trees for the data-layer tests (4x4 PNGs, written with Pillow)."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image


def png(path: Path, value: int = 0) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 4), (value % 256, 40, 80)).save(path)
    return str(path)


def corrupt(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    return str(path)


def truncated_jpeg(path: Path) -> Path:
    """A JPEG cut in half: PIL's verify() passes it (it reads no JPEG data); a full decode does not."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.effect_noise((64, 64), 64).convert("RGB").save(path, quality=95)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def imagefolder(root: Path, classes: list[str], n: int = 3) -> Path:
    for c_i, c in enumerate(classes):
        for i in range(n):
            png(root / c / f"{i:03d}.png", c_i * 10 + i)
    return root


def attributes(path: Path, classes: list[str], k: int = 10) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"_meta": {"doc": "test"}, **{c: [f"phrase {j} of {c}" for j in range(k)] for c in classes}}
    path.write_text(json.dumps(data))
    return path


def coop(root: Path, classes: list[str], n_train: int = 3, n_test: int = 2,
         image_dir: str = "images") -> Path:
    """CoOp dataset folder: root/<image_dir>/<class>/*.png + root/split_zhou_Test.json.

    Entries are written in reverse label order so file order never matches label order."""
    split: dict[str, list] = {"train": [], "val": [], "test": []}
    for label, c in enumerate(classes):
        for name, n in (("train", n_train), ("val", 1), ("test", n_test)):
            for i in range(n):
                rel = f"{c}/{name}_{i}.png"
                png(root / image_dir / rel, label)
                split[name].insert(0, [rel, label, c])
    (root / "split_zhou_Test.json").write_text(json.dumps(split))
    return root


def domainbed(root: Path, domains: list[str], classes: list[str], n: int = 5) -> Path:
    for d in domains:
        imagefolder(root / d, classes, n)
    return root


def fake_world(root: Path, seen: list[str], held: list[str], domains: list[str],
               counts: dict[str, int]) -> Path:
    """A synthetic-world tree; world.json's label order is seen then held (not alphabetical)."""
    classes = [{"label": i, "name": n, "held_out": i >= len(seen)} for i, n in enumerate(seen + held)]
    meta = {"version": 1, "seed": 0, "domains": domains, "splits": counts, "classes": classes,
            "seen": seen, "held_out": held}
    root.mkdir(parents=True, exist_ok=True)
    (root / "world.json").write_text(json.dumps(meta))
    attributes(root / "attributes.json", seen + held)
    for d in domains:
        for split, n in counts.items():
            for c in classes:
                for i in range(n):
                    png(root / d / split / c["name"] / f"{i:04d}.png", c["label"])
    return root
