"""One task of the warm executor (fedmvp_apps/deploy/warm_task.py) against a fake SuperNode Runtime API.

The warm process serves every task of every run, so a task's trouble must end only that task:
- a task token the SuperNode revoked (HTTP 401: it failed the task after a SuperLink restart) must
  not SIGINT the process, as Flower's retry policy does to a one-task ``flwr-clientapp``;
- a task whose ClientApp fails still answers its message (the SuperNode waits for that reply
  before it pulls the next message, of this run or the next one);
- the task waits briefly for a message the SuperNode has not stored yet, and nothing of the task
  (Flower's ``TaskIdentity``) is left for the next one.
"""

from __future__ import annotations

import signal
from types import SimpleNamespace

import httpx
import pytest

from fedmvp_apps.deploy.warm_executor import _flower
from fedmvp_apps.deploy.warm_task import retry_invoker, run_one

F = SimpleNamespace(**{**vars(_flower()), "install_from_fab": lambda *_args, **_kw: None})  # no FAB to unpack
RUN_ID, NODE_ID = 7, 11


def unauthorized() -> httpx.HTTPStatusError:
    request = httpx.Request("POST", "http://127.0.0.1/v1/runtime/pull-object")
    return httpx.HTTPStatusError("401", request=request, response=httpx.Response(401, request=request))


class FakeRuntime:
    """The SuperNode's Runtime API for one claimed task holding one message."""

    def __init__(self, empty_pulls: int = 0, revoke_on: str | None = None, objects_lost: bool = False):
        from flwr.app import ConfigRecord, Context, Message, RecordDict
        from flwr.app.message import remove_content_from_message
        from flwr.common.serde import context_to_proto, fab_to_proto, message_to_proto, run_to_proto
        from flwr.proto.runtime_pb2 import PullTaskInputResponse  # pylint: disable=E0611
        from flwr.supercore.fab import Fab
        from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
        from flwr.supercore.run import Run

        F.TaskIdentity.task_id, F.TaskIdentity.run_id, F.TaskIdentity.node_id = 1, RUN_ID, NODE_ID
        message = Message(RecordDict({"config": ConfigRecord({"x": 1})}), dst_node_id=NODE_ID, message_type="train")
        message.metadata.__dict__["_message_id"] = message.object_id
        message.metadata.__dict__["_src_node_id"] = 1
        self.message_id = message.object_id
        self.tree = get_object_tree(message)
        self.objects = {k: v.deflate() for k, v in get_all_nested_objects(message).items()}
        self.head = message_to_proto(remove_content_from_message(message))
        for name in ("_task_id", "_run_id", "_node_id"):
            setattr(F.TaskIdentity, name, None)
        context = Context(run_id=RUN_ID, node_id=NODE_ID, node_config={}, state=RecordDict(), run_config={})
        run = Run.create_empty(RUN_ID)
        self.input = PullTaskInputResponse(context=context_to_proto(context), run=run_to_proto(run),
                                           fab=fab_to_proto(Fab("hash", b"", {})), task_id=1)
        self.empty_pulls, self.revoke_on, self.objects_lost = empty_pulls, revoke_on, objects_lost
        self.calls: list[str] = []
        self.pushed = []

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name == self.revoke_on:
            raise unauthorized()

    def PullTaskInput(self, _request):
        self._call("PullTaskInput")
        return self.input

    def PullMessages(self, _request):
        from flwr.proto.runtime_pb2 import PullAppMessagesResponse  # pylint: disable=E0611

        self._call("PullMessages")
        if self.empty_pulls:
            self.empty_pulls -= 1
            return PullAppMessagesResponse()
        return PullAppMessagesResponse(messages_list=[self.head], message_object_trees=[self.tree])

    def PullObject(self, request):
        from flwr.proto.message_pb2 import PullObjectResponse  # pylint: disable=E0611

        self._call("PullObject")
        if self.objects_lost:
            return PullObjectResponse(object_found=False, object_available=False)
        return PullObjectResponse(object_found=True, object_available=True,
                                  object_content=self.objects[request.object_id])

    def ConfirmMessageReceived(self, _request):
        from flwr.proto.message_pb2 import ConfirmMessageReceivedResponse  # pylint: disable=E0611

        self._call("ConfirmMessageReceived")
        return ConfirmMessageReceivedResponse()

    def PushMessages(self, request):
        from flwr.common.serde import message_from_proto
        from flwr.proto.runtime_pb2 import PushAppMessagesResponse  # pylint: disable=E0611

        self._call("PushMessages")
        self.pushed.append(message_from_proto(request.messages_list[0]))
        return PushAppMessagesResponse(objects_to_push=[], session_id="s")

    def PushObject(self, _request):
        raise AssertionError("nothing to push")

    def PushTaskOutput(self, request):
        self._call("PushTaskOutput")
        self.output = request
        from flwr.proto.runtime_pb2 import PushTaskOutputResponse  # pylint: disable=E0611

        return PushTaskOutputResponse()

    def SendTaskHeartbeat(self, _request):
        from flwr.proto.runtime_pb2 import SendTaskHeartbeatResponse  # pylint: disable=E0611

        self._call("SendTaskHeartbeat")
        return SendTaskHeartbeatResponse(success=True)

    def close(self) -> None:
        self.calls.append("close")


@pytest.fixture
def no_sigint():
    """Fail if anything signals this process (Flower's policy SIGINTs on a 401)."""
    got = []
    previous = signal.signal(signal.SIGINT, lambda *_: got.append("SIGINT"))
    yield got
    signal.signal(signal.SIGINT, previous)


def app_that(action):
    def load(*_args):
        return action
    return load


def reply_ok(message, context):
    from flwr.app import Message, RecordDict

    return Message(RecordDict(), reply_to=message)


def test_a_completed_task_answers_and_leaves_nothing_behind(no_sigint):
    api = FakeRuntime(empty_pulls=3)  # the SuperNode stores the message a moment after it offers the task
    done, got = run_one(api, F, app_that(reply_ok))
    assert done and got.message.metadata.message_id == api.message_id
    assert [m.metadata.reply_to_message_id for m in api.pushed] == [api.message_id]
    assert api.output.sub_status == F.SubStatus.COMPLETED and api.calls[-1] == "close"
    with pytest.raises(RuntimeError):  # Flower's TaskIdentity is this task's only while it runs
        F.TaskIdentity.run_id
    assert not no_sigint


def test_a_failing_clientapp_still_answers_its_message(no_sigint):
    def boom(message, context):
        raise ValueError("bad data")

    api = FakeRuntime()
    done, _ = run_one(api, F, app_that(boom))
    assert not done
    (reply,) = api.pushed  # the SuperNode waits for exactly this reply before it pulls again
    assert reply.has_error() and "bad data" in reply.error.reason
    assert reply.metadata.reply_to_message_id == api.message_id
    assert api.output.sub_status == F.SubStatus.FAILED


def test_a_message_whose_content_is_lost_is_answered_with_an_error(no_sigint):
    api = FakeRuntime(objects_lost=True)
    done, got = run_one(api, F, app_that(reply_ok))
    assert not done and got.message is None
    (reply,) = api.pushed  # answered from its metadata: without it the SuperNode would wait forever
    assert reply.has_error() and reply.metadata.reply_to_message_id == api.message_id


def test_a_revoked_task_ends_only_itself(no_sigint):
    api = FakeRuntime(revoke_on="PullObject")  # the SuperNode failed the task while we pulled its message
    done, _ = run_one(api, F, app_that(reply_ok))
    assert not done and not no_sigint
    assert "PushMessages" not in api.calls and "PushTaskOutput" not in api.calls  # nothing to answer
    assert api.calls[-1] == "close"


def test_the_retry_policy_gives_up_on_401_without_a_signal(no_sigint):
    invoker = retry_invoker(F)

    def refused():
        raise unauthorized()

    with pytest.raises(httpx.HTTPStatusError):
        invoker.invoke(refused)
    assert not no_sigint
