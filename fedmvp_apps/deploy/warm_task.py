"""One ClientApp task of the warm executor (`warm_executor.py`), run in its long-lived process.

``flwr-clientapp`` runs one task per process, and Flower's runtime helpers are written for that:
a task token the SuperNode no longer knows (HTTP 401) makes Flower's retry policy SIGINT the
process, and a task that fails before it has pulled its message leaves no reply, so the
SuperNode, which waits for exactly one reply per message (``_push_messages`` in Flower's
``start_client_internal``), waits forever. In one process per task the first is how the task
ends; in ours it ended the executor, and so the join (a `fedmvp serve`
killed mid-round, whose restarted SuperLink no longer serves the old run's objects, so the
SuperNode fails that task). Here a task is self-contained: everything of it (its Runtime API
client and token, heartbeat, message, context, Flower's ``TaskIdentity``) lives and ends with it;
a revoked token ends only that task; and once its message is known the task
always answers it, with an error reply if need be, so the SuperNode moves on to the next run's
messages.

The task input is pulled as Flower's ``pull_task_input`` does, with two waits made short: the
SuperNode creates the task a moment before it stores the message (we retry an empty
``PullMessages`` briefly), and it offers the task while it is still pulling the message's objects
from the SuperLink (we poll the local store every few ms, not with Flower's 1 s initial backoff,
which cost a warm site about 1.2 s a message: docs/architecture.md "Layers").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from logging import ERROR, WARNING
from types import SimpleNamespace
from typing import Any

MESSAGE_WAIT_SECONDS = 10.0  # the SuperNode stores the message right after it creates the task
MESSAGE_POLL_SECONDS = 0.02
OBJECT_BACKOFF = (0.01, 0.2)  # the local store's objects arrive as fast as the SuperLink sends them


def dropped(err: BaseException, f: SimpleNamespace) -> bool:
    """Whether ``err`` is the SuperNode's refusal of a task token it revoked (the task is gone)."""
    return isinstance(err, f.httpx.HTTPStatusError) and err.response.status_code == f.httpx.codes.UNAUTHORIZED


def retry_invoker(f: SimpleNamespace):
    """Flower's Runtime API retry policy, except that a 401 gives up (the caller decides) instead of
    SIGINT-ing this process, which serves every later task too."""
    invoker = f.make_simple_http_retry_invoker()
    flower_giveup = invoker.should_giveup

    def giveup(exc: Exception) -> bool:
        if dropped(exc, f):
            return True
        return flower_giveup(exc)

    invoker.should_giveup = giveup
    return invoker


@dataclass
class TaskInput:
    """What one task pulled; ``head`` (the message without content) is known before its objects are."""

    context: Any = None
    run: Any = None
    fab: Any = None
    head: Any = None
    message: Any = None
    stages: dict[str, float] = field(default_factory=dict)


def pull_input(client, f: SimpleNamespace, got: TaskInput) -> None:
    """Flower's ``pull_task_input`` into ``got``, step by step (an error reply needs what was pulled)."""
    res = client.PullTaskInput(f.PullTaskInputRequest())
    f.TaskIdentity.task_id, f.TaskIdentity.run_id = res.task_id, res.run.run_id
    f.TaskIdentity.node_id = res.context.node_id
    got.context, got.run, got.fab = f.context_from_proto(res.context), f.run_from_proto(res.run), f.fab_from_proto(res.fab)
    got.stages["task"] = time.time()
    deadline = time.monotonic() + MESSAGE_WAIT_SECONDS
    while not (pulled := client.PullMessages(f.PullAppMessagesRequest())).messages_list:
        if time.monotonic() > deadline:
            raise RuntimeError("No messages received from Runtime API")
        time.sleep(MESSAGE_POLL_SECONDS)
    got.stages["head"] = time.time()
    tree = pulled.message_object_trees[0]
    got.head = f.message_from_proto(pulled.messages_list[0])
    got.head.metadata.__dict__["_message_id"] = tree.object_id
    node = f.Node(node_id=got.context.node_id)
    message = f.pull_and_inflate_object_from_tree(
        tree, f.make_pull_object_fn_protobuf(client.PullObject, node, got.context.run_id),
        f.make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, got.context.run_id),
        return_type=f.Message, max_tries_per_object=None, initial_backoff=OBJECT_BACKOFF[0],
        backoff_cap=OBJECT_BACKOFF[1])
    message.metadata.__dict__["_message_id"] = tree.object_id
    got.message = message


def run_one(client, f: SimpleNamespace, load_client_app) -> tuple[bool, TaskInput]:
    """Run the claimed task of ``client`` (its token) to its end: (completed, what was pulled).

    Never raises for the task's own trouble: a failed ClientApp is an error reply, a dropped task
    is a log line."""
    got = TaskInput(stages={"start": time.time()})
    revoked: list[bool] = []
    heartbeat = f.HeartbeatSender(_heartbeat_fn(client, f, revoked))
    reply = None
    sub_status, details = f.SubStatus.FAILED, "ClientApp task failed due to unknown reason"
    try:
        heartbeat.start()
        pull_input(client, f, got)
        got.stages["message"] = time.time()
        f.install_from_fab(got.fab.content, skip_prompt=True)
        client_app = load_client_app(got.run.fab_id, got.run.fab_version, got.fab.hash_str)
        got.stages["pulled"] = time.time()
        reply = client_app(message=got.message, context=got.context)
        got.stages["ran"] = time.time()
        sub_status, details = f.SubStatus.COMPLETED, ""
    except Exception as ex:  # pylint: disable=broad-exception-caught  # a failed message, not a dead node
        if dropped(ex, f):
            revoked.append(True)
        else:
            code = f.ErrorCode.LOAD_CLIENT_APP_EXCEPTION if isinstance(ex, f.LoadClientAppError) \
                else f.ErrorCode.CLIENT_APP_RAISED_EXCEPTION
            details = f"{type(ex)}:<'{ex}'>"
            f.log(ERROR, "ClientApp raised an exception", exc_info=ex)
            answered = got.message if got.message is not None else got.head
            if answered is not None:  # the SuperNode waits for this reply before it pulls again
                reply = f.Message(f.Error(code=code, reason=details), reply_to=answered)
    finally:
        _finish(client, f, got, reply, sub_status, details, revoked)
        if heartbeat.is_running:
            heartbeat.stop()
        client.close()
        for name in ("task_id", "run_id", "node_id"):  # nothing of this task carries over to the next
            setattr(f.TaskIdentity, f"_{name}", None)
    return sub_status == f.SubStatus.COMPLETED and not revoked, got


def _finish(client, f: SimpleNamespace, got: TaskInput, reply, sub_status: str, details: str,
            revoked: list[bool]) -> None:
    """Push the reply and the task's output, unless the SuperNode has dropped the task."""
    try:
        if reply is not None and got.context is not None and not revoked:
            f.push_message(client, reply, got.context)
        if not revoked:
            client.PushTaskOutput(f.PushTaskOutputRequest(
                context=f.context_to_proto(got.context) if got.context else None, sub_status=sub_status,
                details=details))
    except Exception as ex:  # pylint: disable=broad-exception-caught
        if dropped(ex, f):
            revoked.append(True)
        else:
            f.log(ERROR, "Failed to push the reply or the task output", exc_info=ex)
    if revoked:
        run = got.context.run_id if got.context is not None else "?"
        f.log(WARNING, "warm ClientApp: the SuperNode dropped this task (run %s: ended, or its message could "
              "not be received); nothing is kept of it", run)


def _heartbeat_fn(client, f: SimpleNamespace, revoked: list[bool]):
    """Flower's task heartbeat, except that a refused one marks the task dropped instead of SIGINT-ing
    the process (``make_task_heartbeat_fn_http`` interrupts ``flwr-clientapp``; here it would end
    every later task)."""
    request = f.SendTaskHeartbeatRequest()
    warned: list[bool] = []

    def beat() -> bool:
        try:
            ok = client.SendTaskHeartbeat(request).success
        except Exception as ex:  # pylint: disable=broad-exception-caught
            if dropped(ex, f):
                revoked.append(True)
                return True  # nothing left to keep alive: no retries
            return False  # transport trouble: Flower's HeartbeatSender retries
        if not ok and not warned:
            warned.append(True)
            f.log(WARNING, "warm ClientApp: the SuperNode no longer knows this task (timed out?)")
        return True

    return beat
