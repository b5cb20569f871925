"""Layout readers (labels indexed explicitly), unreadable images reported once and skipped."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from data_trees import coop, corrupt, domainbed, fake_world, imagefolder, png  # noqa: E402

from fedmvp.data import dataset as ds  # noqa: E402
from fedmvp.data.layouts import (LayoutError, read_coop_split, read_domainbed,  # noqa: E402
                                 read_imagefolder, read_synthetic, write_aircraft_split)
from fedmvp.data.sampling import k_shot  # noqa: E402


def test_imagefolder_sorted_folders_are_labels(tmp_path):
    imagefolder(tmp_path, ["zebra", "ant", "moose"], n=2)
    images = read_imagefolder(tmp_path)
    assert images.class_names == ["ant", "moose", "zebra"]
    assert [(Path(p).parent.name, y) for p, y in images.samples][::2] == [("ant", 0), ("moose", 1), ("zebra", 2)]


@pytest.mark.parametrize("folders, lines, by_folder", [
    (["n02", "n01"], "n01 tench fish\nn02 goldfish\n", {"n01": "tench fish", "n02": "goldfish"}),
    (["n03", "n01"], "n01 tench\nn02 goldfish\nn03 shark\n", {"n01": "tench", "n03": "shark"}),  # A/R subset
    (["0", "2"], "n01 tench\nn02 goldfish\nn03 shark\n", {"0": "tench", "2": "shark"}),  # V2: indices
])
def test_imagefolder_class_names_file_orders_labels(tmp_path, folders, lines, by_folder):
    imagefolder(tmp_path / "data", folders, n=1)
    (tmp_path / "classnames.txt").write_text(lines)
    images = read_imagefolder(tmp_path / "data", tmp_path / "classnames.txt")
    assert images.class_names == list(by_folder.values())  # the file's order, not the folders'
    assert {Path(p).parent.name: images.class_names[y] for p, y in images.samples} == by_folder


def test_imagefolder_unknown_folder_and_missing_root(tmp_path):
    imagefolder(tmp_path / "data", ["n01", "n09"], n=1)
    (tmp_path / "c.txt").write_text("n01 tench\n")
    with pytest.raises(LayoutError, match="n09"):
        read_imagefolder(tmp_path / "data", tmp_path / "c.txt")
    with pytest.raises(LayoutError, match="no such directory"):
        read_imagefolder(tmp_path / "nope")


def test_coop_split_labels_from_entries_not_file_order(tmp_path):
    coop(tmp_path, ["cat", "dog", "emu", "fox"], n_train=2, n_test=1)
    train = read_coop_split(tmp_path / "split_zhou_Test.json", tmp_path / "images", "train")
    assert train.class_names == ["cat", "dog", "emu", "fox"]
    assert len(train) == 8 and all(Path(p).exists() for p, _ in train.samples)
    assert all(Path(p).parent.name == train.class_names[y] for p, y in train.samples)
    test = read_coop_split(tmp_path / "split_zhou_Test.json", tmp_path / "images", "test")
    assert test.class_names == train.class_names and len(test) == 4


@pytest.mark.parametrize("split, message", [
    ({"train": [["a.png", 0, "cat"], ["b.png", 2, "emu"]]}, "labels without any entry: 1"),
    ({"train": [["a.png", 0, "cat"]], "test": [["b.png", 0, "dog"]]}, "label 0 is both 'cat' and 'dog'"),
    ({"train": [["a.png", 0, "cat"], ["b.png", 1, "cat"]]}, "several labels: cat"),
    ({"train": [["a.png", "0", "cat"]]}, r"train\[0\] is not \[relpath, label, classname\]"),
    ({"val": [["a.png", 0, "cat"]]}, "no split 'train'"),
])
def test_coop_split_errors_name_the_file(tmp_path, split, message):
    path = tmp_path / "split_zhou_X.json"
    path.write_text(json.dumps(split))
    with pytest.raises(LayoutError, match=message) as info:
        read_coop_split(path, tmp_path, "train")
    assert str(info.value).startswith(str(path))


def test_domainbed_domains_share_classes(tmp_path):
    domainbed(tmp_path, ["photo", "sketch"], ["dog", "cat"], n=2)
    images = read_domainbed(tmp_path, "sketch")
    assert images.class_names == ["cat", "dog"] and images.domain == "sketch"
    assert all("/sketch/" in p for p, _ in images.samples) and len(images) == 4
    with pytest.raises(LayoutError, match="no domain 'art'"):
        read_domainbed(tmp_path, "art")
    imagefolder(tmp_path / "cartoon", ["cat"], n=1)
    with pytest.raises(LayoutError, match="differ in classes: dog"):
        read_domainbed(tmp_path, "photo")


def test_synthetic_uses_world_label_order(tmp_path):
    fake_world(tmp_path, ["zeta", "alpha"], ["mid"], ["photo"], {"test": 1})
    images = read_synthetic(tmp_path, "photo", "test")
    assert images.class_names == ["zeta", "alpha", "mid"]
    assert {Path(p).parent.name: y for p, y in images.samples} == {"zeta": 0, "alpha": 1, "mid": 2}
    with pytest.raises(LayoutError, match="no domain 'sketch'"):
        read_synthetic(tmp_path, "sketch", "test")


def test_aircraft_split_file(tmp_path):
    (tmp_path / "variants.txt").write_text("707-320\nA300B4\n")
    for split in ("train", "val", "test"):
        (tmp_path / f"images_variant_{split}.txt").write_text("0001 A300B4\n0002 707-320\n")
    out = write_aircraft_split(tmp_path)
    images = read_coop_split(out, tmp_path / "images", "test")
    assert images.class_names == ["707-320", "A300B4"]
    assert [(Path(p).name, y) for p, y in images.samples] == [("0001.jpg", 1), ("0002.jpg", 0)]


def _unreadable(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, ds.UnreadableImageWarning)]


def test_corrupt_image_is_reported_once_and_skipped(tmp_path):
    good = [(png(tmp_path / f"ok{i}.png", i), 0) for i in range(3)]
    bad = corrupt(tmp_path / "bad.png")
    dataset = ds.ImageDataset([*good[:2], (bad, 1), good[2]])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert dataset.check() == [bad]
        assert len(dataset) == 3 and all(p != bad for p, _ in dataset.samples)
        assert not ds.is_readable(bad)  # met again: no second report
        lazy = ds.ImageDataset([(bad, 1), good[0]], transform=lambda im: torch.zeros(3, 4, 4))
        assert lazy[0] is None
        images, labels, index = ds.collate_samples([lazy[0], lazy[1]])
    messages = _unreadable(record)
    assert len(messages) == 1 and bad in messages[0]
    assert images.shape == (1, 3, 4, 4) and labels.tolist() == [0] and index.tolist() == [1]


def test_k_shot_replaces_an_unreadable_pick(tmp_path):
    samples = [(png(tmp_path / f"a{i}.png", i), 0) for i in range(4)]
    first = k_shot(samples, 1, seed=3)[0][0]
    Path(first).write_bytes(b"broken")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        picked = k_shot(samples, 2, seed=3, keep=ds.is_readable)
    assert len(picked) == 2 and first not in [p for p, _ in picked]
    assert len(_unreadable(record)) == 1


def test_stack_samples_makes_a_batch(tmp_path):
    from torchvision.transforms import ToTensor

    samples = [(png(tmp_path / f"{i}.png", i), i % 2) for i in range(3)]
    images, labels = ds.stack_samples(samples, ToTensor())
    assert images.shape == (3, 3, 4, 4) and labels.tolist() == [0, 1, 0]
    item = ds.ImageDataset(samples)[1]
    assert item[0].mode == "RGB" and item[1:] == (1, 1)


def test_training_reads_the_image_files_the_edge_client_reads(tmp_path):
    """One list of image extensions: the edge client's promise, and training follows it."""
    from edge_client.images import IMAGE_EXTENSIONS as EDGE
    from fedmvp_formats.image_folder import IMAGE_EXTENSIONS as TRAINING  # the walk's (folder_walk)

    assert len(TRAINING) == len(set(TRAINING)) and set(TRAINING) == set(EDGE)
    for i, ext in enumerate((".jfif", ".gif", ".PNG")):
        png(tmp_path / "train" / "cat" / f"{i}{ext}", i)
    assert len(read_imagefolder(tmp_path / "train").samples) == 3


def test_an_empty_class_folder_is_named_not_silently_dropped(tmp_path, caplog):
    """A test split whose class folder is empty would score without that class, and say nothing."""
    import logging

    imagefolder(tmp_path / "test", ["ant", "moose"], n=2)
    (tmp_path / "test" / "zebra").mkdir()
    domainbed(tmp_path / "db", ["photo"], ["cat", "dog"], n=1)
    for png_file in (tmp_path / "db" / "photo" / "dog").iterdir():
        png_file.unlink()
    with caplog.at_level(logging.WARNING, logger="fedmvp.data"):
        images = read_imagefolder(tmp_path / "test")
        read_domainbed(tmp_path / "db", "photo")
    assert images.class_names == ["ant", "moose", "zebra"] and 2 not in images.counts
    lines = [r.getMessage() for r in caplog.records]
    assert any("'zebra' holds no images" in line and str(tmp_path / "test") in line for line in lines)
    assert any("'dog' holds no images" in line for line in lines)
