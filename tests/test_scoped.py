"""Library code changes process-wide state only for the length of a block, and puts back exactly what
it changed, also when the block raises: the environment (``fedmvp.scoped.environment``, the
simulation's Ray settings, the hub's offline switch) and another package's attribute (the hub's flag,
Flower's Grid ``pull_objects``)."""

from __future__ import annotations

import os
import types

import pytest

from fedmvp.scoped import attribute, environment


class Boom(Exception):
    pass


def test_environment_restored_after_and_on_error(monkeypatch):
    monkeypatch.setenv("FEDMVP_TEST_SET", "before")
    monkeypatch.delenv("FEDMVP_TEST_UNSET", raising=False)
    for fail in (False, True):
        try:
            with environment({"FEDMVP_TEST_SET": "inside", "FEDMVP_TEST_UNSET": "inside"}):
                assert os.environ["FEDMVP_TEST_SET"] == os.environ["FEDMVP_TEST_UNSET"] == "inside"
                if fail:
                    raise Boom
        except Boom:
            pass
        assert os.environ["FEDMVP_TEST_SET"] == "before"
        assert "FEDMVP_TEST_UNSET" not in os.environ


def test_attribute_restored_or_deleted_after_and_on_error():
    module = types.ModuleType("fake")
    module.present = 1
    with pytest.raises(Boom):
        with attribute(module, "present", 2), attribute(module, "absent", 3):
            assert (module.present, module.absent) == (2, 3)
            raise Boom
    assert module.present == 1 and not hasattr(module, "absent")


def test_offline_load_restores_the_hub(monkeypatch):
    """``clip._offline``: the hub offline inside, and its flag and the environment as they were after."""
    hub = pytest.importorskip("huggingface_hub.constants")
    from fedmvp.clip import _offline

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    with pytest.raises(Boom):
        with _offline(allow_download=False):
            assert hub.HF_HUB_OFFLINE is True and os.environ["HF_HUB_OFFLINE"] == "1"
            raise Boom
    assert hub.HF_HUB_OFFLINE is False and "HF_HUB_OFFLINE" not in os.environ
    assert os.environ["TRANSFORMERS_OFFLINE"] == "0"


def test_bounded_reply_pulls_restores_flowers_grid():
    http_grid = pytest.importorskip("flwr.superlink.grid.http_grid")
    from fedmvp.federated.grid_poll import REPLY_OBJECT_SECONDS, bounded_reply_pulls

    original = http_grid.pull_objects
    with pytest.raises(Boom):
        with bounded_reply_pulls() as bounded:
            assert bounded and http_grid.pull_objects is not original
            assert http_grid.pull_objects.keywords["max_time"] == REPLY_OBJECT_SECONDS
            raise Boom
    assert http_grid.pull_objects is original


def test_simulation_environment_restored_on_error(monkeypatch):
    """``simulate`` sets Ray's and Flower's settings while it runs only: a run that fails leaves the
    caller's environment as it was."""
    from fedmvp.federated import simulation

    seen = {}

    def failing(*args):
        seen.update({key: os.environ.get(key) for key in simulation.SIMULATION_ENV})
        raise Boom

    monkeypatch.setattr(simulation, "_simulate", failing)
    for key in simulation.SIMULATION_ENV:
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(Boom):
        simulation.simulate(run=None)
    assert seen == simulation.SIMULATION_ENV
    assert not any(key in os.environ for key in simulation.SIMULATION_ENV)
