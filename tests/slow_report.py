"""Tests that ran past their budget without the `slow` mark, listed at the end of every run
(docs/testing.md, Markers). A list, not a failure: a loaded machine makes any test slower, and a
deadline on the test itself would fail a test that still works."""

from __future__ import annotations

from collections import defaultdict

import pytest

from tests.deadlines import FACTOR

BUDGET_SECONDS = 120.0  # setup + call + teardown of one test, times FEDMVP_TEST_TIME_FACTOR

_seconds: dict[str, float] = defaultdict(float)
_slow: set[str] = set()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[report.nodeid] += report.duration
    if "slow" in report.keywords:
        _slow.add(report.nodeid)


def over_budget() -> list[tuple[str, float]]:
    """(test, seconds) of every test past the budget that is not marked `slow`, slowest first."""
    budget = BUDGET_SECONDS * FACTOR
    return sorted(((nodeid, s) for nodeid, s in _seconds.items() if s > budget and nodeid not in _slow),
                  key=lambda row: -row[1])


def pytest_terminal_summary(terminalreporter) -> None:
    rows = over_budget()
    if rows:
        terminalreporter.section(f"over {BUDGET_SECONDS * FACTOR:g} s and not marked slow")
        for nodeid, seconds in rows:
            terminalreporter.write_line(f"{seconds:8.1f}s {nodeid}")
