"""Attribute sentences and the text-feature cache."""

from __future__ import annotations

import pytest
import torch

from fedmvp.attributes.cache import TextFeatureCache
from fedmvp.attributes.sentences import SentenceStyle, build_sentences, sentence
from fedmvp.clip import load_clip
from fedmvp.model import FedMVP

ATTRS = {
    "giraffe": [f"long neck {i}" for i in range(10)],
    "zebra": ["is striped"] + [f"black and white stripes {i}" for i in range(9)],
}


@pytest.mark.parametrize("cls,phrase,style,expected", [
    ("giraffe", "exceptionally long neck", SentenceStyle(), "a photo of a giraffe, which has exceptionally long neck"),
    ("zebra", "is striped", SentenceStyle(), "a photo of a zebra, which is striped"),
    ("knife", "used for cutting", SentenceStyle(), "a photo of a knife, which is used for cutting"),
    ("rose", "often red petals.", SentenceStyle.for_domain("sketch", "OxfordFlowers"),
     "a sketch of a rose, a type of flower, which often red petals"),
    ("golden_retriever", "a golden coat", SentenceStyle(), "a photo of a golden retriever, which has a golden coat"),
])
def test_sentence_template(cls, phrase, style, expected):
    assert sentence(cls, phrase, style) == expected


def test_classes_are_indexed_by_label_not_file_order():
    grid = build_sentences(["zebra", "giraffe"], ATTRS)
    assert grid.sentences[0][0].startswith("a photo of a zebra")
    assert len(grid.flat()) == 20 and grid.k == 10
    with pytest.raises(KeyError, match="okapi"):
        build_sentences(["okapi", "zebra"], ATTRS)


def test_long_phrases_use_the_tokenizer_context_not_a_character_cut(tiny_clip):
    long_phrase = "very " * 40 + "long neck"
    tokens = tiny_clip.tokenizer([sentence("giraffe", long_phrase)])
    ctx = tiny_clip.tokenizer.context_length
    assert tokens.shape == (1, ctx)
    assert int(tokens[0, -1]) == tiny_clip.tokenizer.eot_id  # truncated by tokens, EOT kept


def test_text_encoder_runs_once_for_repeated_forwards(tiny_clip, tmp_path):
    cache = TextFeatureCache(tmp_path)
    calls = {"n": 0}
    handle = tiny_clip.model.transformer.register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    try:
        grid = build_sentences(["giraffe", "zebra"], ATTRS)
        model = FedMVP(tiny_clip)
        model.set_text_features(cache.class_features(tiny_clip, grid))
        before = calls["n"]
        images = torch.randn(2, 3, 32, 32)
        for _ in range(3):
            model(images)
            model.set_text_features(cache.class_features(tiny_clip, grid))
        assert calls["n"] == before  # no text encoding after the first
        assert cache.encoder_calls == 1
    finally:
        handle.remove()


def test_disk_cache_is_keyed_by_model_and_sentences(tiny_clip, tmp_path):
    weights = tmp_path / "tiny.safetensors"
    from safetensors.torch import save_file

    save_file(dict(tiny_clip.model.state_dict()), str(weights))
    clip = load_clip("fedmvp-tiny", str(weights))
    grid = build_sentences(["giraffe", "zebra"], ATTRS)
    first = TextFeatureCache(tmp_path / "cache").class_features(clip, grid)
    second_cache = TextFeatureCache(tmp_path / "cache")
    again = second_cache.class_features(clip, grid)
    assert second_cache.encoder_calls == 0 and torch.equal(first, again)
    other = TextFeatureCache(tmp_path / "cache")
    other.class_features(clip, build_sentences(["zebra", "giraffe"], ATTRS))
    assert other.encoder_calls == 1
    assert first.shape == (2, 10, clip.embed_dim)
    assert torch.allclose(first.norm(dim=-1), torch.ones(2, 10))


def test_random_init_is_never_cached_on_disk(tiny_clip, tmp_path):
    TextFeatureCache(tmp_path / "c").class_features(tiny_clip, build_sentences(["giraffe"], ATTRS))
    assert not (tmp_path / "c").exists()
