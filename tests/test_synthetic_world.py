"""The embedded synthetic world: design, determinism, on-disk layout, the CLI and the demo preset."""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedmvp.synthetic.render import image_rng, render
from fedmvp.synthetic.world import (DOMAINS, K_PHRASES, attributes_dict, class_phrases, held_out_classes, load_classes,
                               seen_classes, world_texts)
from fedmvp.synthetic.writer import WORLD_VERSION, ensure_world, write_world

SMALL = {"train": 2, "test": 1}


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def small_world(tmp_path_factory) -> Path:
    return write_world(tmp_path_factory.mktemp("w") / "world", seed=3, counts=SMALL, domains=("photo", "sketch"))


def test_class_design() -> None:
    classes = load_classes()
    assert len(classes) == 64 and len(seen_classes()) == 48 and len(held_out_classes()) == 16
    assert [c.held_out for c in classes] == [False] * 48 + [True] * 16  # label order: seen first
    assert len({c.name for c in classes}) == 64 and all(c.name.isalpha() and c.name.islower() for c in classes)
    assert len({(c.shape, c.colour, c.pattern) for c in classes}) == 64
    assert len({c.description for c in classes}) == 64
    seen = seen_classes()
    for attr in ("shape", "colour", "pattern", "size"):
        seen_values = {getattr(c, attr) for c in seen}
        for c in held_out_classes():  # new classes share every attribute value with seen ones
            assert getattr(c, attr) in seen_values
    assert len({c.shape for c in held_out_classes()}) == 8 and len({c.colour for c in held_out_classes()}) == 8
    # some seen classes differ only by pattern, so patterns matter
    pairs = [(c.shape, c.colour) for c in classes]
    assert len(set(pairs)) < len(pairs)


def test_phrases_in_llm_format() -> None:
    attrs = attributes_dict()
    assert list(attrs) == [c.name for c in load_classes()]
    for name, phrases in attrs.items():
        assert len(phrases) == K_PHRASES == 10
        assert all(isinstance(p, str) and p.strip() == p and p and name not in p for p in phrases)
    c = load_classes()[0]
    assert c.colour in " ".join(class_phrases(c)) and c.shape in class_phrases(c)[-1]


def test_world_texts_fit_the_shipped_vocabulary() -> None:
    """The compact tokenizer's vocabulary file is in sync with the world (no text falls into unknown buckets)."""
    from fedmvp.clip import build_tokenizer

    tok = build_tokenizer("fedmvp-tiny")
    missing = {w for text in world_texts() for w in text.replace(",", " ").split() if not tok.is_known(w)}
    assert not missing, f"regenerate the vocabulary (fedmvp pretrain-tiny --write-vocab): {sorted(missing)[:10]}"
    assert len(tok.table) + 17 < tok.sot_id


@pytest.mark.parametrize("domain", DOMAINS)
def test_render_is_deterministic(domain: str) -> None:
    cls = load_classes()[5]
    a = np.asarray(render(cls, domain, image_rng(0, 1, 2)))
    b = np.asarray(render(cls, domain, image_rng(0, 1, 2)))
    c = np.asarray(render(cls, domain, image_rng(1, 1, 2)))
    assert a.shape == (32, 32, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_write_world_same_seed_same_bytes(small_world: Path, tmp_path: Path) -> None:
    again = write_world(tmp_path / "again", seed=3, counts=SMALL, domains=("photo", "sketch"), workers=1)
    assert tree_digest(small_world) == tree_digest(again)
    # each image has its own seed stream: a subset of the tree has the same bytes as the full one
    subset = write_world(tmp_path / "subset", seed=3, counts={"test": 1}, domains=("sketch",), workers=1)
    sub = {k: v for k, v in tree_digest(subset).items() if k.endswith(".png")}
    full = tree_digest(small_world)
    assert sub and all(full[k] == v for k, v in sub.items())
    other = write_world(tmp_path / "other", seed=4, counts={"test": 1}, domains=("sketch",), workers=1)
    assert tree_digest(other) != tree_digest(subset)


def test_tree_layout(small_world: Path) -> None:
    names = [c.name for c in load_classes()]
    for domain in ("photo", "sketch"):
        for split, count in SMALL.items():
            folder = small_world / domain / split
            assert sorted(p.name for p in folder.iterdir()) == sorted(names)
            for name in names:
                files = sorted(p.name for p in (folder / name).iterdir())
                assert files == [f"{i:04d}.png" for i in range(count)]
    img = Image.open(small_world / "photo" / "train" / names[0] / "0000.png")
    assert img.mode == "RGB" and img.size == (32, 32)
    assert not (small_world / "painting").exists() and not (small_world / "photo" / "val").exists()
    assert not list(small_world.parent.glob("*.tmp-*"))


def test_tree_is_an_imagefolder(small_world: Path) -> None:
    from torchvision.datasets import ImageFolder

    ds = ImageFolder(str(small_world / "sketch" / "train"))
    assert len(ds.classes) == 64 and len(ds) == 64 * SMALL["train"]
    image, label = ds[0]
    assert image.size == (32, 32) and ds.classes[label] == sorted(c.name for c in load_classes())[0]


def test_attributes_and_world_json(small_world: Path) -> None:
    attrs = json.loads((small_world / "attributes.json").read_text())
    meta = attrs.pop("_meta")
    assert meta["k"] == 10 and meta["world_version"] == WORLD_VERSION
    folders = {p.name for p in (small_world / "photo" / "train").iterdir()}
    assert set(attrs) == folders
    assert all(isinstance(v, list) and len(v) == 10 and all(isinstance(p, str) for p in v) for v in attrs.values())

    world = json.loads((small_world / "world.json").read_text())
    assert world["seed"] == 3 and world["version"] == WORLD_VERSION
    assert world["domains"] == ["photo", "sketch"] and world["splits"] == SMALL
    assert [c["name"] for c in world["classes"]] == list(attrs)
    assert [c["label"] for c in world["classes"]] == list(range(64))
    for c in world["classes"]:
        assert set(c) >= {"name", "description", "shape", "colour", "pattern", "size", "held_out"}
    assert world["seen"] == [c["name"] for c in world["classes"] if not c["held_out"]]
    assert len(world["held_out"]) == 16


def test_ensure_world_reuses_and_never_leaves_half_a_tree(tmp_path: Path, monkeypatch) -> None:
    import fedmvp.synthetic.writer as ww

    root = tmp_path / "cache-world"
    counts = {"test": 1}
    calls = {"n": 0}
    real = ww.render

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 20:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(ww, "render", flaky)
    with pytest.raises(KeyboardInterrupt):
        ensure_world(root, seed=0, counts=counts, domains=("photo",), workers=1)
    assert not root.exists() and not list(tmp_path.glob("*.tmp-*"))
    monkeypatch.setattr(ww, "render", real)

    made = ensure_world(root, seed=0, counts=counts, domains=("photo",), workers=1)
    stamp = (made / "world.json").stat().st_mtime_ns
    assert ensure_world(root, seed=0, counts=counts, domains=("photo",)) == made
    assert (made / "world.json").stat().st_mtime_ns == stamp
    with pytest.raises(FileExistsError):
        ensure_world(root, seed=1, counts=counts, domains=("photo",))


def test_ensure_world_default_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FEDMVP_CACHE", str(tmp_path))
    root = ensure_world(seed=2, counts={"val": 1}, domains=("painting",), workers=1)
    assert root.parent == tmp_path and root.name.startswith(f"world-2-v{WORLD_VERSION}")
    assert len(list(root.rglob("*.png"))) == 64


def test_cli_world(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from fedmvp_apps.cli import main

    out = tmp_path / "cli-world"
    result = CliRunner().invoke(main, ["world", "--out", str(out), "--seed", "1", "--train", "1", "--val", "0",
                                       "--test", "1", "--domains", "photo", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["images"] == 128 and summary["held_out"] == 16 and Path(summary["root"]) == out
    again = CliRunner().invoke(main, ["world", "--out", str(out), "--domains", "photo"])
    assert again.exit_code == 2 and "not empty" in again.output
    bad = CliRunner().invoke(main, ["world", "--out", str(tmp_path / "x"), "--domains", "cartoon"])
    assert bad.exit_code == 2 and "unknown domain" in bad.output


def test_demo_preset_fits_the_world() -> None:
    preset = tomllib.loads((Path(__file__).resolve().parents[1] / "fedmvp/presets/demo.toml").read_text())
    assert preset["model"] == {"clip": "fedmvp-tiny", "pretrained": "synthetic"}
    (ds,) = preset["datasets"]
    assert ds["layout"] == "synthetic"
    assert ds["base_classes"] <= len(seen_classes()) and ds["new_classes"] == len(held_out_classes())
    assert ds["base_classes"] % ds["classes_per_client"] == 0
    assert set(ds["train_domains"]).isdisjoint(ds["test_domains"])
    assert set(ds["train_domains"]) | set(ds["test_domains"]) <= set(DOMAINS)
    assert preset["train"]["shots"] <= 16  # train images per class and domain in the default world
