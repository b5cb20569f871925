"""The deployment group first: the run is as long as its `deployment` tests, one after another.

With two xdist workers the other worker runs every unit test in the first part of the run and then
waits, while the `deployment` group, one worker's serial chain of federations, sets the run's length.
Until the unit tests are done both compete for the two cores, and a federation's processes (SuperLink,
SuperNodes, each site's training) stretch: measured, the edge-device deployment test took 115 s beside a
busy 2-thread torch process and 89 s alone.

A nice value does not settle it: Linux shares the CPU first between sessions (autogroups; every command
a deployment test starts runs in a session of its own), and only then by nice within each. So once the
group has started (its worker leaves ``FLAG`` in the run's shared temporary folder), every other worker,
before its next test, moves into a session of its own and lowers that session's weight by ``NICE``
steps (``/proc/self/autogroup``): the unit tests and the commands they start get the cores the
deployments leave idle (a federation waits on its network and on its processes' starts much of the
time). Nothing changes for one worker (``-n 0``) or off Linux; raising a nice value needs no privilege.
A worker in a session of its own no longer gets the terminal's Ctrl-C itself: pytest-xdist's
controller gets it and stops the worker after its current test, a unit test of seconds.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

NICE = 10  # autogroup nice steps of the other workers once the deployments run (Linux: -20 .. 19)
FLAG = "deployments-started"
GROUP = "deployments"  # the xdist group of `deployment` and `timed` tests: one worker, never stepping aside
FIRST_MARKS = ("deployment", "timed")


def in_first_group(item: pytest.Item) -> bool:
    """A federation (`deployment`) or a wall-clock bound (`timed`): run by the worker that keeps its weight,
    so a deadline a test asserts is never measured in a session that yields the cores."""
    return any(item.get_closest_marker(mark) is not None for mark in FIRST_MARKS)
_state = {"flag": None, "done": False}


def _flag(config: pytest.Config) -> Path:
    """``FLAG`` in the folder every worker's basetemp lies in (one per pytest run)."""
    return config._tmp_path_factory.getbasetemp().parent / FLAG  # type: ignore[attr-defined]


def step_aside(nice: int = NICE, autogroup: Path = Path("/proc/self/autogroup")) -> bool:
    """A session of this process's own, its weight lowered by ``nice``; False where Linux says no
    (already a session or group leader, no autogroups, not allowed)."""
    if not autogroup.is_file():
        return False
    try:
        os.setsid()
        autogroup.write_text(str(nice))
    except OSError:
        return False
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if _state["done"] or not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if _state["flag"] is None:
        _state["flag"] = _flag(item.config)
    if in_first_group(item):
        _state["flag"].touch()  # this worker runs the group: the others step aside
        _state["done"] = True
    elif _state["flag"].exists():
        step_aside()
        _state["done"] = True
