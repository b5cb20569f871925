"""The real-photo site maker (benchmarks/real_photos.py): what it writes is a site folder every reader
accepts, its attribute file loads, and on the shipped tiny CLIP the vocabulary check flags its real
class names (the measured run: docs/tutorials/one-machine.md "Your own class names on the tiny CLIP")."""

from __future__ import annotations

import pytest

pytest.importorskip("skimage", reason="the maker reads scikit-image's photos (the dev extra)")


def test_the_maker_writes_site_folders_the_check_accepts_and_the_tiny_clip_is_warned(tmp_path):
    from benchmarks.real_photos import PHOTOS, make_sites
    from fedmvp.attributes.files import load_attributes
    from fedmvp.attributes.sentences import SentenceStyle
    from fedmvp.clip import load_clip
    from fedmvp.data.site_folder import read_site_folder
    from fedmvp.run_classes import RunClass
    from fedmvp.vocabulary_check import measure

    classes = list(PHOTOS)
    made = make_sites(tmp_path, ["north", "south"], classes, per_class=5)
    assert made == {"north": classes, "south": classes}
    attributes = load_attributes(tmp_path / "attributes.json", classes, k=10)  # ten phrases per class
    sites = {s: read_site_folder(tmp_path / s, classes, ["rocket", "galaxy"], 0.2) for s in made}
    for site in sites.values():  # 5 crops a class: 1 held out per base class, every new-class image
        assert sorted(site.counts.values()) == [5] * len(classes)
        assert len(site.train) == 4 * 6 and len(site.test) == 6 + 2 * 5
    north = sorted(p.read_bytes() for p in (tmp_path / "north" / "cat").iterdir())
    south = sorted(p.read_bytes() for p in (tmp_path / "south" / "cat").iterdir())
    assert north != south  # each site its own crops, as two real sites would hold
    assert not [p for p in tmp_path.rglob(".*")]  # no temp file left behind

    result = measure(load_clip("fedmvp-tiny", "synthetic"),
                     [RunClass(c, tuple(attributes[c]), SentenceStyle()) for c in classes])
    assert result.warns and result.unknown_name_share == 1.0 and result.text_similarity > 0.95
    assert "cannot tell these 8 classes apart by text" in result.warning()
