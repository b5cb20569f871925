"""tests/priority.py: once the deployment group runs, another worker steps aside into a session of
its own whose weight is lowered, so the federations get the cores first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHILD = """
import os, sys
sys.path.insert(0, sys.argv[1])
from tests.priority import NICE, step_aside
print(step_aside(), os.getsid(0) == os.getpid(), open("/proc/self/autogroup").read().split()[-1], NICE)
"""


@pytest.mark.processes  # a child steps aside (a test's own interpreter must keep its session)
@pytest.mark.skipif(not Path("/proc/self/autogroup").is_file(), reason="no autogroups (not Linux, or turned off)")
def test_a_worker_that_steps_aside_leads_its_own_session_at_a_lower_weight() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD, str(REPO)], capture_output=True, text=True, timeout=60)
    moved, leader, nice, wanted = done.stdout.split()
    assert (moved, leader, nice) == ("True", "True", wanted), done.stderr


def test_without_autogroups_nothing_moves(tmp_path) -> None:
    from tests.priority import step_aside

    assert step_aside(autogroup=tmp_path / "no-autogroup") is False


class Marked:
    """An item as the group rule sees it: its marks by name."""

    def __init__(self, *marks: str) -> None:
        self.marks = {mark: pytest.Mark(mark, (), {}) for mark in marks}

    def get_closest_marker(self, name: str):
        return self.marks.get(name)


@pytest.mark.parametrize(("marks", "first"), [
    ((), False),
    (("processes",), False),
    (("deployment", "processes"), True),
    (("timed",), True),  # a wall-clock bound is never measured in a worker that yields the cores
    (("slow", "timed"), True),
])
def test_federations_and_wall_clock_bounds_run_in_the_worker_that_keeps_its_weight(marks, first) -> None:
    from tests.priority import in_first_group

    assert in_first_group(Marked(*marks)) is first


def test_every_timed_test_is_collected_into_the_deployment_group(request) -> None:
    """The suite's own `timed` tests (this session's items) carry the group xdist schedules by."""
    timed = [item for item in request.session.items if item.get_closest_marker("timed") is not None]
    for item in timed:
        assert [m.args for m in item.iter_markers("xdist_group")] == [("deployments",)], item.nodeid
