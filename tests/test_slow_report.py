"""The end-of-run list of tests past 120 s without the `slow` mark (tests/slow_report.py)."""

from __future__ import annotations

from types import SimpleNamespace

from tests import slow_report


def test_only_unmarked_tests_past_the_budget_are_listed_slowest_first(monkeypatch) -> None:
    monkeypatch.setattr(slow_report, "_seconds", slow_report.defaultdict(float))
    monkeypatch.setattr(slow_report, "_slow", set())
    monkeypatch.setattr(slow_report, "FACTOR", 1.0)
    reports = [("a", 100.0, {}), ("a", 30.0, {}),  # setup + call: 130 s in all
               ("b", 119.0, {}), ("c", 500.0, {"slow": 1}), ("d", 200.0, {})]
    for nodeid, seconds, keywords in reports:
        slow_report.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=seconds, keywords=keywords))
    assert slow_report.over_budget() == [("d", 200.0), ("a", 130.0)]
    monkeypatch.setattr(slow_report, "FACTOR", 2.0)  # a loaded machine's factor widens the budget too
    assert slow_report.over_budget() == []
