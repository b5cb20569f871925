"""A site's folder counts images by content and class names after Unicode normalisation: what a site reports
is weighed by the server (docs/security.md "Replayed and duplicated updates")."""

from __future__ import annotations

import shutil
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedmvp.data.site_folder import SiteFolderError, read_site_folder
from tests.federated.conftest import small_world  # noqa: F401 (the synthetic world the join test's preset names)

CAFE = unicodedata.normalize("NFC", "café")


def _images(folder: Path, count: int, seed: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        paths.append(folder / f"{seed}-{i}.png")
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(paths[-1])
    return paths


def test_byte_identical_copies_count_once_in_any_class_or_split(tmp_path):
    one = _images(tmp_path / "site" / "dog", 4, 1)[0]
    for i in range(40):  # 40 copies of one image under other names, one of them in another class
        target = tmp_path / "site" / ("cat" if i == 0 else "dog") / f"copy-{i}.png"
        target.parent.mkdir(exist_ok=True)
        shutil.copyfile(one, target)
    _images(tmp_path / "site" / "cat", 2, 2)
    images = read_site_folder(tmp_path / "site", ["cat", "dog"], [], 0.25)
    # 41 files of one content count once: the first by path (cat/copy-0.png), so dog keeps its other 3
    assert images.duplicates == 40 and images.counts == {"cat": 3, "dog": 3}
    kept = [path for path, _ in images.train + images.test]
    assert len(kept) == 6 and [p for p in kept if Path(p).read_bytes() == one.read_bytes()] == \
        [str(tmp_path / "site" / "cat" / "copy-0.png")]


def test_a_class_folder_in_another_unicode_form_is_that_class_and_two_spellings_are_refused(tmp_path):
    nfd = unicodedata.normalize("NFD", CAFE)
    assert nfd != CAFE
    _images(tmp_path / "site" / nfd, 3, 1)
    _images(tmp_path / "site" / "tea", 3, 2)
    images = read_site_folder(tmp_path / "site", [CAFE, "tea"], [], 0.0)
    assert images.counts == {CAFE: 3, "tea": 3}
    _images(tmp_path / "site" / CAFE, 3, 3)  # the same class spelt twice: not twice the images
    with pytest.raises(SiteFolderError, match="a second folder of class 'café'.*two Unicode spellings"):
        read_site_folder(tmp_path / "site", [CAFE, "tea"], [], 0.0)


def test_join_says_the_copies_in_one_line(tmp_path, small_world, monkeypatch):
    from click.testing import CliRunner

    from fedmvp_apps.cli import main
    from fedmvp_apps.deploy import supernode
    from tests.site_trees import site_preset, world_classes

    seen, _ = world_classes(small_world)
    preset = site_preset(tmp_path, small_world, {"site-a": seen[:2], "site-b": seen[2:3]}, [])
    folder = tmp_path / "sites" / "site-a"
    first = next(p for p in sorted((folder / seen[0]).iterdir()))
    for i in range(3):
        shutil.copyfile(first, folder / seen[0] / f"copy-{i}{first.suffix}")
    launched = []
    monkeypatch.setattr(supernode, "become_supernode", lambda args, **_: launched.append(args))
    result = CliRunner().invoke(main, ["join", "--superlink", "127.0.0.1:1", "--insecure", "--config", str(preset),
                                       "--data", str(folder), "--name", "site-a"])
    assert result.exit_code == 0 and launched, result.output
    lines = [line for line in result.stderr.splitlines() if "byte-identical" in line]
    assert lines == [f"warning: {folder.resolve()}: 3 files left out as byte-identical copies of images counted once"]
