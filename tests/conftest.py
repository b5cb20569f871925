"""Shared fixtures: the tiny random-init CLIP, a temporary fedmvp cache, quiet logs."""

from __future__ import annotations

import logging

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _quiet() -> None:
    logging.getLogger().setLevel(logging.ERROR)
    torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch) -> None:
    """Never read or write the user's ~/.cache/fedmvp from tests (world cache is shared per session)."""
    monkeypatch.setenv("FEDMVP_TEXT_CACHE", str(tmp_path_factory.mktemp("text-cache")))


@pytest.fixture(scope="session")
def tiny_clip():
    from fedmvp.clip import load_clip

    torch.manual_seed(0)
    return load_clip("fedmvp-tiny", None)


@pytest.fixture
def tiny_model(tiny_clip):
    from fedmvp.model import FedMVP

    torch.manual_seed(0)
    model = FedMVP(tiny_clip)
    feats = torch.nn.functional.normalize(torch.randn(6, 10, tiny_clip.embed_dim), dim=-1)
    model.set_text_features(feats)
    return model
