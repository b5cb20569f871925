"""How the buffered server pulls the replies it awaits without a fast device ever waiting for a slow one
(docs/architecture.md "Buffered versions for devices").

A buffered server has up to ``ceil(over_selection x concurrency)`` messages out at once and looks for
their replies several times a second. Flower's ``Grid.pull_messages`` does two things in one call: one
Runtime API request (``PullMessages``) that hands over the replies that arrived, then, one reply after
the other, the requests that fetch each reply's objects (its tensors). Called with every awaited id, a
reply whose objects are late (a device paused or killed while it uploads) would hold up every reply
behind it; called once per awaited id (``SeparatePulls``), it costs the SuperLink one request per
awaited message per poll: at 50 devices out, hundreds of requests a second, most of the SuperLink's
CPU (the fleet benchmark, docs/benchmarks.md "Fleets").

``BatchedPulls`` splits the two: one ``PullMessages`` request per poll for all awaited ids, then each
reply that arrived has its objects fetched, confirmed and inflated in a thread of its own, exactly as
Flower's ``HttpGrid.pull_messages`` does for one message (a reply whose objects never come becomes
Flower's own ``MESSAGE_UNAVAILABLE`` error reply, after ``grid_poll.bounded_reply_pulls``'s bound). It
needs the deployed ``HttpGrid``'s Runtime API client (Flower 1.42, pinned in pyproject.toml);
``reply_pulls`` uses ``SeparatePulls`` on any other Grid (the simulation's, a test's).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable

from flwr.app import Message, Metadata
from flwr.app.error import Error
from flwr.app.message import make_message
from flwr.common.constant import ErrorCode
from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest  # pylint: disable=E0611
from flwr.proto.runtime_pb2 import PullAppMessagesRequest  # pylint: disable=E0611
from flwr.superlink.grid import http_grid
from flwr.supercore.constant import SYSTEM_MESSAGE_TYPE
from flwr.supercore.date import now
from flwr.supercore.inflatable.inflatable_object import iterate_object_tree
from flwr.supercore.inflatable.inflatable_protobuf_utils import make_pull_object_fn_protobuf
from flwr.supercore.inflatable.inflatable_utils import ObjectPullError, inflate_object_from_contents


class SeparatePulls:
    """Replies pulled one message at a time, each in a thread of its own (any Grid): one small request
    per awaited message per poll."""

    def __init__(self, grid, workers: int):
        self.grid = grid
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="fedmvp-pull")
        self.running: dict[str, Future] = {}

    def poll(self, message_ids: Iterable[str]) -> list[Message]:
        """The replies (or Flower's error replies) that are complete now, to any of ``message_ids``."""
        wanted = set(message_ids)
        for message_id in wanted - set(self.running):
            self.running[message_id] = self.pool.submit(lambda m=message_id: list(self.grid.pull_messages([m])))
        return self._done(wanted)

    def _done(self, wanted: set[str]) -> list[Message]:
        replies: list[Message] = []
        for message_id, future in list(self.running.items()):
            if future.done():
                del self.running[message_id]
                if message_id in wanted:
                    replies.extend(future.result())
        return replies

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class BatchedPulls(SeparatePulls):
    """One ``PullMessages`` request a poll for every awaited reply (``HttpGrid`` only); each reply found
    completed (its objects pulled, its receipt confirmed) in a thread of its own."""

    def poll(self, message_ids: Iterable[str]) -> list[Message]:
        wanted = set(message_ids)
        asked = sorted(wanted - set(self.running))  # a reply being completed was handed over already
        if asked:
            found = self.grid._runtime_client.PullMessages(PullAppMessagesRequest(message_ids=asked))
            for head, tree in zip(found.messages_list, found.message_object_trees, strict=True):
                reply_to = head.metadata.reply_to_message_id
                if reply_to in wanted:
                    self.running[reply_to] = self.pool.submit(self._complete, head, tree)
        return self._done(wanted)

    def _complete(self, head, tree) -> list[Message]:
        """One reply's objects pulled and inflated, its receipt confirmed: Flower's ``pull_messages`` for
        one message (its error reply where the objects never came)."""
        grid = self.grid
        run_id, message_id = grid.run.run_id, head.metadata.message_id
        try:
            contents = http_grid.pull_objects(  # looked up now: ``grid_poll.bounded_reply_pulls`` bounds it
                object_ids=[node.object_id for node in iterate_object_tree(tree)],
                pull_object_fn=make_pull_object_fn_protobuf(pull_object_protobuf=grid._runtime_client.PullObject,
                                                            node=grid.node, run_id=run_id))
        except ObjectPullError as err:
            return [self._unavailable(head, err)]
        grid._runtime_client.ConfirmMessageReceived(ConfirmMessageReceivedRequest(
            node=grid.node, run_id=run_id, message_object_id=message_id))
        message = inflate_object_from_contents(message_id, contents)
        message.metadata.__dict__["_message_id"] = message_id  # as Flower's pull_messages sets it
        return [message]

    def _unavailable(self, head, err: Exception) -> Message:
        """Flower's error reply for a reply whose objects never came (as ``HttpGrid.pull_messages`` makes it)."""
        server = self.grid.node.node_id
        metadata = Metadata(run_id=self.grid.run.run_id, message_id="", src_node_id=server, dst_node_id=server,
                            message_type=SYSTEM_MESSAGE_TYPE, group_id="", ttl=0,
                            reply_to_message_id=head.metadata.reply_to_message_id, created_at=now().timestamp())
        return make_message(metadata=metadata, error=Error(
            code=ErrorCode.MESSAGE_UNAVAILABLE,
            reason=f"Reply message objects are unavailable. The sender may not have completed the upload "
                   f"before the object-push session expired. {err}"))


def reply_pulls(grid, workers: int) -> SeparatePulls:
    """``BatchedPulls`` on the deployed Grid, ``SeparatePulls`` on any other; ``workers`` threads complete
    replies at once (the devices kept busy)."""
    return (BatchedPulls if isinstance(grid, http_grid.HttpGrid) else SeparatePulls)(grid, workers)
