"""Dropouts and over-selection (fedmvp/federated/dropouts.py, docs/howto/buffered.md "Dropouts and
over-selection"): the real strategies on a Grid in-process (``BufferedGrid``: devices that reply after
some pulls, or never), each [server] key changed and the messages sent / versions written looked at."""

from __future__ import annotations

import logging
import time

import pytest

from fedmvp.federated.buffered import BufferedStrategy
from fedmvp.federated.round_writer import RoundWriter
from fedmvp.federated.sampling import over_selected
from fedmvp.federated.strategy import FedMVPStrategy, RoundPolicy, StrategyOptions
from fedmvp.federated.wire import array_record
from fedmvp.presets.server import ServerRecordError, ServerSpec
from fedmvp.runs import RunDir
from tests.federated.test_aggregation import RUN, _flower_run_identity  # noqa: F401 (fixture)
from tests.federated.test_privacy_rounds import THETA, BufferedGrid, states

NEVER = 10 ** 9  # pulls before a device replies: it vanished


class Stop(Exception):
    """Raised by the buffered loop's sleep once a test has seen enough."""


def strategy(path, mode: type = FedMVPStrategy, fraction: float = 1.0, total: int = 1, stop_after: float = 20.0,
             **server) -> FedMVPStrategy:
    """The real strategy writing its rounds under ``path``; a buffered loop stops (``Stop``) after
    ``stop_after`` seconds."""
    run = RunDir(path)
    run.write_config({"rounds": total})
    options = StrategyOptions(client_config={}, seed=0, total_rounds=total, base_lr=0.1, num_clients=1, run_id=RUN,
                              policy=RoundPolicy(fraction, ServerSpec(**{"min_nodes": 1, "node_wait": 5, **server})))
    if mode is FedMVPStrategy:
        made = mode(options, RoundWriter(run, options.policy.server))
    else:
        end = time.monotonic() + stop_after

        def sleep(seconds: float) -> None:
            if time.monotonic() > end:
                raise Stop
            time.sleep(0.002)

        made = mode(options, RoundWriter(run, options.policy.server), sleep=sleep)
    made.evaluate_round = lambda grid, state, number: {}
    return made


def test_over_selection_counts_and_range():
    assert [over_selected(10, f, 100) for f in (1.0, 1.3, 1.05, 2.0)] == [10, 13, 11, 20]  # 1.3 x 10 is 13
    assert over_selected(10, 1.3, 11) == 11 and over_selected(0, 1.3, 5) == 0
    for key, value, message in [("over_selection", 0.9, "over_selection must be a finite number >= 1"),
                                ("min_buffer", 0, "min_buffer must be at least 1"),
                                ("min_buffer", 3, "min_buffer must be at most buffer_size 2")]:
        with pytest.raises(ServerRecordError, match=message):
            ServerSpec().with_overrides({key: value}, "preset.toml")
    assert ServerSpec.from_record(ServerSpec(over_selection=1.3, min_buffer=1).record(), "x").over_selection == 1.3


@pytest.mark.parametrize("factor, sent", [(1.0, 2), (1.5, 3), (2.0, 4)])
def test_a_sync_round_over_selects_devices_and_closes_once_it_has_the_wanted_replies(tmp_path, caplog, factor,
                                                                                     sent):
    """Half of four devices wanted: ceil(factor x 2) are sent work. Two devices answer at once, two never:
    over-selected, the round closes as soon as the wanted two replied (not at round_timeout) and the
    devices still out are recorded and said as late, never averaged."""
    grid = BufferedGrid({7: 0, 8: NEVER, 9: 0, 10: NEVER})
    made = strategy(tmp_path, fraction=0.5, over_selection=factor, round_timeout=1.5 if factor == 1.0 else 60)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        made.start(grid, array_record(THETA), num_rounds=1)
    assert grid.sent == sent  # the key reaches the messages sent
    state = states(tmp_path)[0]
    asked = sorted(m.metadata.dst_node_id for m in grid.out.values()) + [r["node"] for r in state["replies"]]
    answered = [r["node"] for r in state["replies"]]
    assert state["devices"]["selected"] == sent and state["devices"]["wanted"] == 2
    assert state["devices"]["replied"] == len(answered)
    if factor == 1.0:  # the seeded draw of two; whoever of them never replied timed out
        assert state["late"] == [] and state["devices"]["late"] == 0
        assert len(state["timed_out"]) == state["devices"]["timed_out"] == 2 - len(answered)
        return
    assert sorted(answered) == [7, 9] and state["seconds"] < 10  # closed at once, not at round_timeout 60
    late = sorted(n for n in asked if n not in answered)
    assert state["late"] == [f"edge node {n}" for n in late] and state["devices"]["late"] == sent - 2
    assert state["timed_out"] == [] and state["devices"]["timed_out"] == 0
    for node in late:
        assert f"round 1: edge node {node} discarded as late: the round had its 2 device replies " \
               f"(over_selection {factor:g})" in caplog.text


def test_a_late_reply_that_arrived_with_the_wanted_ones_is_discarded_not_averaged(tmp_path, caplog):
    grid = BufferedGrid({7: 0, 8: 0, 9: 0, 10: NEVER})  # three answer in one pull, two are wanted
    made = strategy(tmp_path, fraction=0.5, over_selection=2.0, round_timeout=60)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        made.start(grid, array_record(THETA), num_rounds=1)
    state = states(tmp_path)[0]
    answered = {r["node"] for r in state["replies"]}
    late = {int(name.split()[-1]) for name in state["late"]}
    assert len(answered) == 2 and 10 in late and len(late) == 2 and not answered & late
    assert state["devices"] == {"selected": 4, "wanted": 2, "replied": 3, "late": 2, "timed_out": 0}
    assert state["metrics"]["edges"] == 2


@pytest.mark.parametrize("factor, timed_out", [(1.0, ["edge node 7", "edge node 8"]), (2.0, [])])
def test_buffered_over_selection_keeps_more_devices_busy_so_vanished_ones_do_not_stall(tmp_path, factor, timed_out):
    """Devices 7 and 8 vanished, 9 and 10 are fast; concurrency 2, buffer_size 1. Without over-selection
    the least served 7 and 8 are sent the work and the version waits round_timeout for them (then 9 and 10
    are sent it); with 2.0, four devices are busy at once and the version is written from the first fast
    reply."""
    grid = BufferedGrid({7: NEVER, 8: NEVER, 9: 0, 10: 0})
    made = strategy(tmp_path, BufferedStrategy, concurrency=2, buffer_size=1, round_timeout=2.0,
                    over_selection=factor)
    began = time.monotonic()
    first = made._send
    busy = []
    made._send = lambda *a: first(*a) or busy.append(len(made.pending))
    made.registry.roles.update(dict.fromkeys(grid.delay, "edge"))  # met before: work goes out at the first send
    made.start(grid, array_record(THETA), num_rounds=1)
    assert busy[0] == 2 * factor  # the key reaches the messages sent
    state = states(tmp_path)[0]
    assert state["devices"]["selected"] == 4 and state["timed_out"] == timed_out
    assert state["devices"]["timed_out"] == len(timed_out) and state["devices"]["closed"] == "buffer_size"
    assert (time.monotonic() - began >= 2.0) == (factor == 1.0)


class OnceGrid(BufferedGrid):
    """Device 7 answers its first message at once and vanishes after; every other device never answers."""

    def pull_messages(self, ids):
        replies = super().pull_messages(ids)
        if any(r.metadata.src_node_id == 7 and r.metadata.message_type == "train" for r in replies):
            self.delay[7] = NEVER
        return replies


@pytest.mark.parametrize("min_buffer", [None, 2, 1])
def test_min_buffer_writes_a_version_with_what_arrived_after_round_timeout(tmp_path, caplog, min_buffer):
    """buffer_size 2, one update arrives and every device vanishes: by default (and min_buffer 2) the version
    waits; with min_buffer 1 it is written with that one update once it has gathered round_timeout seconds."""
    made = strategy(tmp_path, BufferedStrategy, stop_after=3.0, concurrency=2, buffer_size=2, round_timeout=1.0,
                    min_buffer=min_buffer)
    began = time.monotonic()
    with caplog.at_level(logging.INFO, logger="flwr"):
        if min_buffer != 1:
            with pytest.raises(Stop):
                made.start(OnceGrid({7: 0, 8: NEVER}), array_record(THETA), num_rounds=1)
            assert states(tmp_path) == []
            return
        made.start(OnceGrid({7: 0, 8: NEVER}), array_record(THETA), num_rounds=1)
    assert 1.0 <= time.monotonic() - began < 3.0
    state = states(tmp_path)[0]
    assert [r["node"] for r in state["replies"]] == [7] and state["devices"]["closed"] == "min_buffer"
    assert state["devices"]["taken"] == 1 and state["devices"]["wanted"] == 2
    assert "version 1 written from 1 device updates (staleness [0]), after round_timeout 1 s with min_buffer 1" \
        in caplog.text


@pytest.mark.parametrize("max_staleness", [0, 20])
def test_max_staleness_leaves_a_stale_buffered_reply_out_with_a_line_and_a_record(tmp_path, caplog, max_staleness):
    """Device 8 replies after a few pulls while the fast 7 writes versions: its reply is based on version 0.
    max_staleness 0 leaves it out (a line, ``rejected``, ``devices.stale``); 20 takes it, discounted."""
    made = strategy(tmp_path, BufferedStrategy, total=10, concurrency=2, buffer_size=1, max_staleness=max_staleness)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        made.start(BufferedGrid({7: 0, 8: 3}), array_record(THETA), num_rounds=10)
    recorded = states(tmp_path)
    from_8 = [r for s in recorded for r in s["replies"] if r["node"] == 8]
    stale = [(s, r) for s in recorded for r in s["rejected"] if r["node"] == 8]
    if max_staleness == 0:
        assert not from_8 and stale
        assert all("max_staleness 0" in r["reason"] for _, r in stale)
        assert sum(s["devices"]["stale"] for s in recorded) == len(stale)
        assert "reply of node 8 (edge device) left out: based on version 0" in caplog.text
    else:
        assert from_8 and any(r["staleness"] >= 1 and r["s"] < 1 for r in from_8) and not stale
        assert all(s["devices"]["stale"] == 0 for s in recorded)


class MuteGrid(BufferedGrid):
    """Node 11 is connected but never answers who it is (it paused or died right after it connected)."""

    def send_and_receive(self, messages, timeout=None):
        return [r for r in super().send_and_receive(messages, timeout) if r.metadata.src_node_id != 11]


@pytest.mark.timed  # asserts on the wall clock: runs where the cores go first (docs/testing.md)
def test_a_node_that_never_says_who_it_is_holds_up_no_version(tmp_path):
    """Buffered versions ask new nodes who they are without waiting for the answer: with a mute node 11
    connected, the fast 7 and 8 write 5 versions well within one round_timeout (a server that waited for
    the identities would stop round_timeout at every send), and 11 is asked again once its query expired."""
    made = strategy(tmp_path, BufferedStrategy, total=5, concurrency=2, buffer_size=1, round_timeout=1.5)
    grid = MuteGrid({7: 0, 8: 0, 11: 0})
    began = time.monotonic()
    made.start(grid, array_record(THETA), num_rounds=5)
    assert time.monotonic() - began < 1.5
    assert len(states(tmp_path)) == 5 and {r["node"] for s in states(tmp_path) for r in s["replies"]} <= {7, 8}
    assert made.registry.site_of(11) is None and [a.node for a in made.asking.values()] == [11]

    later = strategy(tmp_path / "again", BufferedStrategy, total=20, concurrency=2, buffer_size=1, round_timeout=0.5)
    grid = MuteGrid({7: 20, 11: 0})  # 7 replies after 20 pulls: the 20 versions outlive 11's first query
    began = time.monotonic()
    later.start(grid, array_record(THETA), num_rounds=20)
    assert time.monotonic() - began > 0.5, "the versions came too fast to see a query expire"
    assert grid.asked.count(11) >= 2  # its query expired after round_timeout and it was asked again
