"""The backbone's vocabulary check (fedmvp.vocabulary_check): the two figures and when they warn.

The thresholds were chosen from these measurements (docs/tutorials/one-machine.md "Your own class names
on the tiny CLIP"): the demo's class set on the shipped tiny CLIP must never warn, scikit-image's photo
names on it must."""

from __future__ import annotations

import pytest

from fedmvp.attributes.prompt import offline_attributes
from fedmvp.attributes.sentences import SentenceStyle
from fedmvp.run_classes import RunClass
from fedmvp.vocabulary_check import VocabularyCheck, measure, read_record, recorded_warning, words

PHOTO_NAMES = ["astronaut", "camera", "coffee", "chelsea", "rocket", "horse", "coins", "clock", "page", "brick"]


@pytest.fixture(scope="module")
def shipped_tiny():
    from fedmvp.clip import load_clip

    return load_clip("fedmvp-tiny", "synthetic")


def run_classes(names: list[str], phrases) -> list[RunClass]:
    return [RunClass(n, tuple(phrases(n)), SentenceStyle()) for n in names]


def test_the_demo_class_set_on_the_shipped_tiny_clip_does_not_warn(shipped_tiny):
    from fedmvp.synthetic.world import attributes_dict, held_out_classes, seen_classes

    attrs = attributes_dict()
    names = [c.name for c in seen_classes()[:24] + held_out_classes()]  # the demo preset's base + new
    result = measure(shipped_tiny, run_classes(names, lambda n: attrs[n][:10]))
    assert (result.unknown_word_share, result.unknown_name_share) == (0.0, 0.0)
    assert result.text_similarity < 0.2 and not result.warns
    # the tutorial's synthetic names with `attributes generate --offline` phrases: template words unknown, harmless
    tutorial = measure(shipped_tiny, run_classes(["meengfov", "vooshkov", "klapdrik", "spukbee"], offline_attributes))
    assert tutorial.unknown_word_share > 0.3 and tutorial.unknown_name_share == 0.0 and not tutorial.warns


def test_real_photo_names_on_the_shipped_tiny_clip_warn_once_with_the_fix(shipped_tiny):
    result = measure(shipped_tiny, run_classes(PHOTO_NAMES, offline_attributes))
    assert result.unknown_name_share == 1.0 and result.text_similarity > 0.95 and result.warns
    assert set(PHOTO_NAMES) <= set(result.unknown_words)
    line = result.warning()
    assert "\n" not in line and "cannot tell these 10 classes apart by text" in line
    assert "near chance" in line and "docs/howto/weights.md" in line and 'clip = "ViT-B-16"' in line
    record = result.record()
    assert record["warns"] and record["text_similarity"] == result.text_similarity
    assert recorded_warning(record) == line  # what `fedmvp evaluate` shows from the run's record


def test_open_clips_bpe_has_no_unknown_words():
    """A real CLIP's tokenizer (open_clip's BPE) splits any word into its own pieces: share 0."""
    from fedmvp.clip import load_clip

    clip = load_clip("ViT-B-32", None)  # random init: only the tokenizer's answer is asserted
    result = measure(clip, run_classes(PHOTO_NAMES[:3], offline_attributes))
    assert (result.unknown_word_share, result.unknown_name_share, result.unknown_words) == (0.0, 0.0, ())


@pytest.mark.parametrize("record", [None, {}, {"clip": "x"}, {"clip": "x", "classes": "many", "unknown_word_share": 0,
                                                                "unknown_name_share": 1, "text_similarity": 0.99},
                                    []])
def test_an_unusable_record_shows_no_warning(record):
    assert recorded_warning(record) is None


def test_a_recorded_clip_name_reaches_the_terminal_escaped():
    figures = VocabularyCheck("tiny\x1b[2J", 3, 1.0, 1.0, 0.99, ()).record()
    assert "\x1b" not in recorded_warning(figures)


def test_words_and_a_missing_record(tmp_path):
    assert words(["red_panda", "Red fur, long TAIL"]) == ["red", "panda", "fur", "long", "tail"]
    assert read_record(tmp_path) is None
    (tmp_path / "vocabulary.json").write_text("[1]")
    assert read_record(tmp_path) is None
