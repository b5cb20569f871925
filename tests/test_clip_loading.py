"""Backbone loading: names, tags, local files, offline errors, frozen weights."""

from __future__ import annotations

import http.server
import logging
import pickle
import threading

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


def _torchscript_archive(state: dict[str, torch.Tensor], path) -> None:
    """A TorchScript archive holding ``state`` under its dotted names, as OpenAI ships CLIP."""

    class Holder(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    root = Holder()
    for key, value in state.items():
        *parents, leaf = key.split(".")
        module = root
        for part in parents:
            if not hasattr(module, part):
                module.add_module(part, Holder())
            module = getattr(module, part)
        module.register_buffer(leaf, value.clone())
    torch.jit.save(torch.jit.script(root), str(path))


def test_openai_torchscript_archive_loads_with_quick_gelu(tiny_clip, tmp_path):
    from open_clip.transformer import QuickGELU

    state = {k: v.clone() for k, v in tiny_clip.model.state_dict().items()}
    _torchscript_archive(state, tmp_path / "openai.pt")
    save_file(state, str(tmp_path / "converted.safetensors"))
    archive = load_clip("fedmvp-tiny", str(tmp_path / "openai.pt"))
    converted = load_clip("fedmvp-tiny", str(tmp_path / "converted.safetensors"))
    for key, value in archive.model.state_dict().items():
        assert torch.equal(value, state[key]), key
    activation = lambda clip: type(clip.model.visual.transformer.resblocks[0].mlp.gelu)  # noqa: E731
    assert activation(archive) is QuickGELU  # OpenAI's weights were trained with it
    assert activation(converted) is not QuickGELU  # a plain weights file keeps the config's activation


def test_a_weights_file_load_does_not_claim_random_init(tiny_clip, tmp_path, caplog):
    save_file({k: v.clone() for k, v in tiny_clip.model.state_dict().items()}, str(tmp_path / "w.safetensors"))
    with caplog.at_level(logging.WARNING):
        load_clip("fedmvp-tiny", str(tmp_path / "w.safetensors"))
    assert not [r for r in caplog.records if "initialized randomly" in r.getMessage()]
    with caplog.at_level(logging.WARNING):
        load_clip("fedmvp-tiny")  # really random: open_clip may say so
    assert [r for r in caplog.records if "initialized randomly" in r.getMessage()]


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


@pytest.fixture
def local_hub(monkeypatch):
    """A Hugging Face endpoint on 127.0.0.1 that answers 404 and counts what reaches it."""
    from huggingface_hub import constants

    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            hits.append(self.path)
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_HEAD = _answer

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    yield hits
    server.shutdown()


def test_download_needed_offline_says_what_to_pass_and_never_asks_the_hub(local_hub, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty hub cache
    with pytest.raises(ClipLoadError, match=r"downloads are off; set the preset.s \[model\] pretrained to a weights file"):
        load_clip("ViT-B-32", "openai", cache_dir=str(tmp_path))
    assert local_hub == []  # huggingface_hub was imported before: the env alone would not stop it
    with pytest.raises(ClipLoadError, match="could not fetch ViT-B-32 / openai"):
        load_clip("ViT-B-32", "openai", cache_dir=str(tmp_path), allow_download=True)
    assert local_hub and all("vit_base_patch32_clip_224.openai" in path for path in local_hub)
