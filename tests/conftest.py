"""Shared fixtures: the tiny random-init CLIP, a temporary fedmvp cache, quiet logs."""

from __future__ import annotations

import logging

import pytest
import torch

from fedmvp.federated.ray_token import ensure_ray_token
from tests.deadlines import FACTOR
from tests.process_markers import (  # noqa: F401  (hooks: the `processes` marker tells the truth)
    install,
    pytest_fixture_setup,
    pytest_runtest_makereport,
    pytest_runtest_protocol,
)
from tests.priority import GROUP, in_first_group, pytest_runtest_setup  # noqa: F401  (hook: the deployment group first)
from tests.slow_report import pytest_runtest_logreport, pytest_terminal_summary  # noqa: F401  (hooks)

install()
# Every Ray cluster a test starts (in this process or a command it runs) requires a token, as `fedmvp train`'s
# does: Ray reads the mode once per process, before anything here may load it (fedmvp/federated/ray_token.py).
ensure_ray_token()


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items) -> None:
    """Tests that start a federation share one xdist group, so two deployments never compete for the
    machine's cores (a `deployment` test is a `processes` test too); `timed` tests, which bound the wall
    clock, join that group: its worker never steps aside (tests/priority.py). Every pytest-timeout limit
    is scaled by FEDMVP_TEST_TIME_FACTOR (tests/deadlines.py)."""
    for item in items:
        if item.get_closest_marker("deployment") is not None:
            item.add_marker(pytest.mark.processes)
        if in_first_group(item):
            item.add_marker(pytest.mark.xdist_group(GROUP))
        if FACTOR != 1:
            marker = item.get_closest_marker("timeout")
            seconds = marker.args[0] if marker is not None and marker.args else float(config.getini("timeout") or 0)
            item.add_marker(pytest.mark.timeout(seconds * FACTOR), append=False)


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
