"""Backbone loading: names, tags, local files, offline errors, frozen weights."""

from __future__ import annotations

import pickle

import pytest
import torch
from safetensors.torch import save_file

from fedmvp.clip import ClipLoadError, load_clip


def test_random_init_is_frozen_and_has_no_identity(tiny_clip):
    assert tiny_clip.identity is None
    assert not any(p.requires_grad for p in tiny_clip.model.parameters())
    assert not tiny_clip.model.training


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_local_weights_file_loads_identically(tiny_clip, tmp_path, suffix):
    state = {k: v.clone() for k, v in tiny_clip.model.state_dict().items()}
    path = tmp_path / f"tiny{suffix}"
    if suffix == ".safetensors":
        save_file(state, str(path))
    else:
        torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}}, path)
    loaded = load_clip("fedmvp-tiny", str(path))
    assert loaded.identity and loaded.identity.startswith("fedmvp-tiny:sha256:")
    for key, value in loaded.model.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_pickled_object_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("unpickled!",))

    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps({"x": Evil()}))
    with pytest.raises(ClipLoadError, match="evil.pt"):
        load_clip("fedmvp-tiny", str(path))


def test_weights_that_do_not_fit_name_the_file(tmp_path):
    path = tmp_path / "wrong.safetensors"
    save_file({"visual.conv1.weight": torch.zeros(1)}, str(path))
    with pytest.raises(ClipLoadError, match="wrong.safetensors: does not fit fedmvp-tiny"):
        load_clip("fedmvp-tiny", str(path))


def test_missing_weights_file(tmp_path):
    with pytest.raises(ClipLoadError, match="not found"):
        load_clip("fedmvp-tiny", str(tmp_path / "nope.safetensors"))


def test_unknown_model_and_unknown_tag():
    with pytest.raises(ClipLoadError, match="unknown CLIP model 'ViT-Z-99'"):
        load_clip("ViT-Z-99")
    with pytest.raises(ClipLoadError, match="neither a pretrained tag"):
        load_clip("fedmvp-tiny", "laion9000")


def test_download_needed_offline_says_what_to_pass(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty hub cache
    with pytest.raises(ClipLoadError, match=r"downloads are off; pass a weights file"):
        load_clip("ViT-B-32", "openai", cache_dir=str(tmp_path))
