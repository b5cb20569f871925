"""Prompt injection into open_clip's ViT: zero prompts reproduce encode_image exactly."""

from __future__ import annotations

import json

import open_clip
import pytest
import torch

from fedmvp.clip import load_clip
from fedmvp.prompted_vit import encode_image_prompted, patch_embeds


@pytest.fixture(scope="module")
def odd_clip(tmp_path_factory):
    """Another width and patch size (not the tiny config) to show the injection is generic."""
    cfg = {"embed_dim": 48, "vision_cfg": {"image_size": 24, "layers": 2, "width": 96, "head_width": 32,
                                           "patch_size": 6},
           "text_cfg": {"context_length": 16, "vocab_size": 500, "width": 64, "heads": 2, "layers": 1}}
    path = tmp_path_factory.mktemp("cfg") / "test-odd-vit.json"
    path.write_text(json.dumps(cfg))
    open_clip.add_model_config(path)
    torch.manual_seed(1)
    return load_clip("test-odd-vit", None)


@pytest.mark.parametrize("which", ["tiny_clip", "odd_clip"])
def test_zero_prompts_equal_open_clip_encode_image(which, request):
    clip = request.getfixturevalue(which)
    images = torch.randn(3, 3, clip.image_size, clip.image_size)
    expected = clip.model.encode_image(images)
    assert torch.equal(encode_image_prompted(clip.model.visual, images), expected)
    empty = torch.zeros(3, 0, clip.vision_width)
    assert torch.equal(encode_image_prompted(clip.model.visual, images, empty), expected)


def test_prompts_change_the_feature_and_have_no_positional_embedding(tiny_clip):
    visual = tiny_clip.model.visual
    images = torch.randn(2, 3, 32, 32)
    tokens = patch_embeds(visual, images)
    assert tokens.shape == (2, 1 + tiny_clip.num_patches, tiny_clip.vision_width)
    prompts = torch.randn(2, 4, tiny_clip.vision_width)
    out = encode_image_prompted(visual, images, prompts)
    assert out.shape == (2, tiny_clip.embed_dim)
    assert not torch.allclose(out, tiny_clip.model.encode_image(images))
    # Prompts are appended after the positional embedding: swapping two prompts leaves CLS unchanged
    # only if no position is attached to them.
    swapped = encode_image_prompted(visual, images, prompts[:, [1, 0, 2, 3]])
    assert torch.allclose(out, swapped, atol=1e-5)
