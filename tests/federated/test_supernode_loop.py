"""What `fedmvp_apps/deploy/supernode_process.py` changes of Flower's SuperNode loop: its waits (short
right after a reply, when the next round's message is due, longer when idle, never Flower's 3 s; local
looks always short), and a message whose run ended while it was received, which Flower 1.42 left as a
pending task that the warm executor then waited on for 2 hours (the server-restart flake)."""

from __future__ import annotations

import importlib

import pytest

from fedmvp_apps.deploy.supernode_process import HEARTBEAT_SECONDS, IDLE_PULL_SECONDS, LOCAL_POLL_SECONDS, \
    PacedTime, beat_sooner, pace, release_ended_runs


class Clock:
    def __init__(self) -> None:
        self.now, self.waits = 100.0, []

    def __call__(self) -> float:
        return self.now

    def wait(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds


@pytest.mark.parametrize("since_reply,asked,paused", [
    (None, 3, IDLE_PULL_SECONDS),  # never replied: idle
    (0.0, 3, 0.05),  # just replied
    (0.3, 3, 0.15),  # half the time since
    (0.8, 3, 0.4),
    (30.0, 3, IDLE_PULL_SECONDS),  # long idle: capped
    (0.0, 0.5, LOCAL_POLL_SECONDS),  # a look at the node's own state
    (30.0, 0.5, LOCAL_POLL_SECONDS),
    (0.0, 0.01, 0.01),  # never longer than asked
], ids=["never", "just", "0.3s", "0.8s", "idle", "local", "local-idle", "shorter"])
def test_a_wait_follows_the_time_since_the_last_reply(since_reply, asked, paused):
    clock = Clock()
    paced = PacedTime(clock=clock, wait=clock.wait)
    if since_reply is not None:
        paced.replied()
        clock.now += since_reply
    paced.sleep(asked)
    assert clock.waits == [pytest.approx(paused)]


def test_after_a_reply_a_message_a_second_later_is_seen_within_a_third_of_a_second():
    clock = Clock()
    paced = PacedTime(clock=clock, wait=clock.wait)
    paced.replied()
    start = clock.now
    while clock.now - start < 1.0:  # Flower's loop: an empty pull, then its 3 s sleep
        paced.sleep(3)
    assert clock.now - start - 1.0 <= 1.0 / 3 + 1e-9 and len(clock.waits) <= 12


def test_flowers_loop_is_paced_and_its_push_marks_a_reply():
    loop = importlib.import_module("flwr.supernode.start_client_internal")
    original_time, original_push, original_pull = loop.time, loop._push_messages, loop.pull_objects
    try:
        loop._push_messages = lambda *a, **k: None
        assert pace(loop)
        loop._push_messages()
        assert loop.time.last_reply > float("-inf")
    finally:
        loop.time, loop._push_messages, loop.pull_objects = original_time, original_push, original_pull


@pytest.mark.parametrize("released", [False, True], ids=["flower-as-is", "released"])
def test_a_message_whose_run_ended_while_it_was_received_fails_its_task(released, monkeypatch):
    """Flower's own loop function, state and object store: the run ends (RunNotRunningException, a
    BaseException) while the message's objects are pulled. As Flower wrote it the task stays pending
    with the message (the executor claims it and waits on objects that never come); released, Flower
    deletes the message and fails the task, which revokes the executor's token."""
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.supercore.inflatable.inflatable_object import get_object_tree
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supercore.run import Run, RunNotRunningException
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.supernode.nodestate.nodestate_factory import NodeStateFactory

    loop = importlib.import_module("flwr.supernode.start_client_internal")
    monkeypatch.setattr(loop, "_pull_and_store_message", loop._pull_and_store_message)  # restored after
    if released:
        assert release_ended_runs(loop)
    stores = ObjectStoreFactory()
    state, store = NodeStateFactory(stores).state(), stores.store()
    state.set_node_id(5)
    for name, value in (("run_id", 7), ("node_id", 1), ("task_id", 1)):
        monkeypatch.setattr(TaskIdentity, f"_{name}", value, raising=False)
    run = Run.create_empty(7)
    run.primary_task_type, run.fab_hash = "", "fab"
    state.store_run(run)  # a run this node already knows: no GetRun, no FAB
    message = Message(content=RecordDict({"config": ConfigRecord({"round": 3})}), dst_node_id=5, message_type="train")
    message.metadata.__dict__["_message_id"] = message.object_id

    def pull_object(run_id: int, object_id: str) -> bytes:
        raise RunNotRunningException()

    got = loop._pull_and_store_message(
        state=state, object_store=store, node_config={}, receive=lambda: (message, get_object_tree(message)),
        get_run=None, get_fab=None, pull_object=pull_object, confirm_message_received=lambda *_: None,
        trusted_entities=None)
    assert got is None
    (task,) = state.get_tasks()
    if released:
        assert (task.status.status, task.status.sub_status) == ("finished", "failed")
        assert "no longer running" in task.status.details
        assert state.get_messages_legacy(is_reply=False) == []
    else:  # the orphan this fixes
        assert task.status.status == "pending" and len(state.get_messages_legacy(is_reply=False)) == 1


def test_heartbeats_promise_flowers_least_interval_and_are_sent_at_its_pace(monkeypatch):
    """The interval the node promises the SuperLink (at activation and with every beat) and the pace of
    Flower's own sender both follow ``beat_sooner``; Flower's SuperLink accepts the promise."""
    from flwr.common.constant import HEARTBEAT_MAX_INTERVAL, HEARTBEAT_MIN_INTERVAL, HEARTBEAT_PATIENCE
    from flwr.supercore import heartbeat
    from flwr.supernode import fleet_http_connection

    for module in (heartbeat, fleet_http_connection):
        monkeypatch.setattr(module, "HEARTBEAT_DEFAULT_INTERVAL", module.HEARTBEAT_DEFAULT_INTERVAL)  # restored after
    assert beat_sooner()
    assert fleet_http_connection.HEARTBEAT_DEFAULT_INTERVAL == HEARTBEAT_SECONDS == HEARTBEAT_MIN_INTERVAL
    assert HEARTBEAT_MIN_INTERVAL <= HEARTBEAT_SECONDS <= HEARTBEAT_MAX_INTERVAL  # the SuperLink's bounds
    assert HEARTBEAT_PATIENCE * HEARTBEAT_SECONDS == 20  # a dead node is known gone this much later
    sent = []
    sender = heartbeat.HeartbeatSender(lambda: sent.append(1) or True)
    waits = []
    sender._stop_event.wait = lambda seconds: waits.append(seconds) or len(waits) >= 3
    sender._stop_event.is_set = lambda: len(waits) >= 3
    sender._run()
    assert len(sent) == 3 and all(0 < w < HEARTBEAT_SECONDS / 2 for w in waits), waits
    assert not beat_sooner(1) or fleet_http_connection.HEARTBEAT_DEFAULT_INTERVAL == HEARTBEAT_MIN_INTERVAL
