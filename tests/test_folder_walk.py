"""The one rule for walking a user's folder (fedmvp_formats.folder_walk), one row per kind of entry, and
each reader held to it: a site's folder, a device's folder, the dataset layouts."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fedmvp_formats.folder_walk import FolderWalk, image_files
from fedmvp_formats.shown import path_shown
from tests.data_trees import png, truncated_jpeg


def _site(root: Path) -> Path:
    """root/site/{cat,dog}/{0,1,2}.png, and root/outside/x/{e0,e1}.png (a folder kept elsewhere)."""
    for c_i, c in enumerate(("cat", "dog")):
        for i in range(3):
            png(root / "site" / c / f"{i}.png", c_i * 10 + i)
    for i in range(2):
        png(root / "outside" / "x" / f"e{i}.png", 100 + i)
    return root / "site"


def _link(path: Path, target: str | Path) -> None:
    path.symlink_to(target)


def _socket(path: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # the socket file stays


# (id, setup(site, root), images listed per class, fragment of the one refusal or None)
ROWS: list[tuple[str, Callable[[Path, Path], None], dict[str, int], str | None]] = [
    ("plain", lambda s, r: None, {"cat": 3, "dog": 3}, None),
    ("link-to-parent", lambda s, r: _link(s / "cat" / "up", ".."), {"cat": 3, "dog": 3}, "leads back into"),
    ("link-to-folder-itself", lambda s, r: _link(s / "cat" / "me", "."), {"cat": 3, "dog": 3}, "leads back into"),
    ("link-above-the-folder", lambda s, r: _link(s / "cat" / "top", "/"), {"cat": 3, "dog": 3}, "leads back into"),
    ("link-to-sibling-class", lambda s, r: _link(s / "cat" / "more", "../dog"), {"cat": 3, "dog": 3},
     "leads back into"),
    ("file-link-inside", lambda s, r: _link(s / "cat" / "best.png", "0.png"), {"cat": 3, "dog": 3},
     "leads back into"),
    ("hard-link", lambda s, r: os.link(s / "cat" / "0.png", s / "dog" / "same.png"), {"cat": 3, "dog": 3},
     "the same file as"),
    ("two-links-to-one-outside-folder", lambda s, r: (_link(s / "cat" / "x", r / "outside" / "x"),
                                                      _link(s / "dog" / "x", r / "outside" / "x")),
     {"cat": 5, "dog": 3}, "the same folder as"),
    ("loop-outside", lambda s, r: (_link(s / "cat" / "x", r / "outside" / "x"),
                                   _link(r / "outside" / "x" / "loop", r / "outside")),
     {"cat": 5, "dog": 3}, "the same folder as"),
    ("fifo", lambda s, r: os.mkfifo(s / "cat" / "x.jpg"), {"cat": 3, "dog": 3}, "a FIFO (named pipe)"),
    ("socket", lambda s, r: _socket(s / "cat" / "s.png"), {"cat": 3, "dog": 3}, "a socket"),
    ("fifo-without-an-image-name", lambda s, r: os.mkfifo(s / "cat" / "notes"), {"cat": 3, "dog": 3}, None),
    ("broken-link", lambda s, r: _link(s / "cat" / "gone.png", r / "nowhere.png"), {"cat": 3, "dog": 3},
     "a broken link"),
    ("link-outside-allowed", lambda s, r: _link(s / "cat" / "x", r / "outside" / "x"), {"cat": 5, "dog": 3}, None),
    ("file-link-outside-allowed", lambda s, r: _link(s / "dog" / "e.png", r / "outside" / "x" / "e0.png"),
     {"cat": 3, "dog": 4}, None),
    ("hidden-skipped", lambda s, r: png(s / "cat" / ".hidden.png"), {"cat": 3, "dog": 3}, None),
]


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_the_walking_rule(tmp_path, row):
    _, setup, counts, fragment = row
    site = _site(tmp_path)
    setup(site, tmp_path)
    walk = FolderWalk(site)
    found = {c: walk.images(site / c) for c in ("cat", "dog")}
    assert {c: len(files) for c, files in found.items()} == counts
    everything = [f for files in found.values() for f in files]
    assert len({os.path.realpath(f) for f in everything}) == len(everything)  # nothing listed twice
    if fragment is None:
        assert walk.problems == []
    else:
        [line] = walk.problems  # one line, naming the entry
        assert fragment in line and line.startswith(str(site)) and "\n" not in line


@pytest.mark.timed  # asserts on the wall clock: runs where the cores go first (docs/testing.md)
def test_two_loop_links_finish_at_once(tmp_path):
    """Two links up, followed, were 2**40 paths: the folder check never ended."""
    site = _site(tmp_path)
    _link(site / "cat" / "a", "..")
    _link(site / "cat" / "b", "../..")
    began = time.monotonic()
    files, refusals = image_files(site)
    assert time.monotonic() - began < 1 and len(files) == 6 and len(refusals) == 2


def test_a_folder_given_through_a_link_is_walked(tmp_path):
    """The folder the user names may itself be a link (only links below it obey the rule)."""
    site = _site(tmp_path)
    _link(tmp_path / "mine", site)
    files, refusals = image_files(tmp_path / "mine")
    assert len(files) == 6 and refusals == []


@pytest.mark.parametrize("name, escaped", [("a\nb.png", "a\\nb.png"), ("x\x1b[31mred.png", "x\\x1b[31mred.png"),
                                           ("ok é.png", "ok é.png")])
def test_file_names_are_shown_escaped(name, escaped):
    assert path_shown(f"/d/{name}") == f"/d/{escaped}"
    assert path_shown(os.fsdecode(b"/d/bad-\xfe.png")) == "/d/bad-\\xfe.png"


def test_a_name_with_a_newline_reaches_a_refusal_escaped(tmp_path):
    site = _site(tmp_path)
    os.mkfifo(site / "cat" / "evil\n\x1b[2Jname.png")
    walk = FolderWalk(site)
    walk.images(site)
    [line] = walk.problems
    assert "\n" not in line and "\x1b" not in line and "evil\\n\\x1b[2Jname.png" in line


# ---- each reader holds to the rule -------------------------------------------------------------------------
def test_a_site_folder_refuses_a_link_back_instead_of_counting_its_images_again(tmp_path):
    """A link up inside a class folder took a site's images from 20 to 336 (its FedAvg weight 0.5 -> 0.955)."""
    pytest.importorskip("torch")
    from fedmvp.data.site_folder import SiteFolderError, read_site_folder

    site = _site(tmp_path)
    assert read_site_folder(site, ["cat", "dog"], [], 0.2).counts == {"cat": 3, "dog": 3}
    _link(site / "cat" / "up", "..")
    with pytest.raises(SiteFolderError) as err:
        read_site_folder(site, ["cat", "dog"], [], 0.2)
    [line] = err.value.problems
    assert line.startswith(f"{site / 'cat' / 'up'}: a link that leads back into")


def test_a_site_folder_counts_what_training_decodes(tmp_path):
    """A truncated JPEG passed PIL's verify, was counted in the site's classes, then dropped by training:
    num-examples and classes disagreed and the server refused every reply of the site."""
    pytest.importorskip("torch")
    from fedmvp.data.dataset import ImageDataset, UnreadableImageWarning, is_readable
    from fedmvp.data.site_folder import SiteFolderError, read_site_folder

    site = _site(tmp_path)
    bad = truncated_jpeg(site / "dog" / "cut.jpg")
    with pytest.warns(UnreadableImageWarning, match="truncated"):
        assert not is_readable(str(bad))
    assert ImageDataset([(str(bad), 0)])[0] is None  # what training does with it
    with pytest.raises(SiteFolderError) as err:
        read_site_folder(site, ["cat", "dog"], [], 0.2)
    [line] = err.value.problems
    assert line.startswith(f"{bad}: unreadable image")


def test_a_layout_refuses_a_link_back(tmp_path):
    pytest.importorskip("torch")
    from fedmvp.data.layouts import LayoutError, read_imagefolder

    site = _site(tmp_path)
    _link(site / "dog" / "again", "../cat")
    with pytest.raises(LayoutError, match="leads back into"):
        read_imagefolder(site)


def test_a_device_folder_refuses_a_hard_link_and_a_fifo(tmp_path):
    from edge_client.images import ImageReadError, load_image
    from edge_client.local_data import scan_folder
    from edge_client.train_options import TrainInputError

    site = _site(tmp_path)
    assert len(scan_folder(site, ["cat", "dog"]).files) == 6
    os.link(site / "cat" / "0.png", site / "dog" / "same.png")
    with pytest.raises(TrainInputError, match="the same file as"):
        scan_folder(site, ["cat", "dog"])
    os.unlink(site / "dog" / "same.png")
    os.mkfifo(site / "cat" / "x.jpg")
    with pytest.raises(TrainInputError, match="FIFO"):
        scan_folder(site, ["cat", "dog"])
    with pytest.raises(ImageReadError, match="refused without opening it"):
        load_image(site / "cat" / "x.jpg")  # named on its own: stat'ed, never opened
