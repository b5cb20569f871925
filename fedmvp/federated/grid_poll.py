"""``Grid.send_and_receive`` with a short poll: push a round's messages, then pull replies until all
came or the round timeout passed.

Flower 1.42's deployment Grid (``flwr.superlink.grid.http_grid``) sleeps a fixed 3 s between two
pulls of the replies, so a deployed round waits 1.5 s on average after its last reply, twice a
round (train, evaluate; the deploy benchmark, benchmarks/deploy.py, measures it). Here the wait starts at
``FIRST_POLL_SECONDS`` and grows to at most ``MAX_POLL_SECONDS`` (one small Runtime API request on
the server's own SuperLink each time). The replies are the same ones Flower's method returns;
their order may differ, and the strategy sorts them before it averages (docs/method.md).

``bounded_reply_pulls``: the same Grid pulls a reply's objects (its tensors) for up to 2 hours, backing
off from 1 s to 10 s, until they arrive. A device killed between pushing a reply and pushing its
objects (seen in the buffered test) therefore stalled the server for that long; a healthy reply's
objects follow its head at once. Bounded, the stuck reply becomes Flower's own error reply
(``MESSAGE_UNAVAILABLE``) after ``REPLY_OBJECT_SECONDS``, which the strategy leaves out like any
failed reply, and objects still on their way are polled every few ms rather than after 1 s.
"""

from __future__ import annotations

import contextlib
import time
from functools import partial
from typing import Callable, Iterable, Iterator

from fedmvp.scoped import attribute

REPLY_OBJECT_SECONDS = 30.0  # Flower: 7200 s (500 tries) before a reply with missing objects fails
OBJECT_BACKOFF = (0.02, 0.5)  # Flower: 1 s doubling to 10 s

FIRST_POLL_SECONDS = 0.05
MAX_POLL_SECONDS = 0.25  # Flower: 3 s


def send_and_receive(grid, messages: Iterable, timeout: float | None,
                     enough: Callable[[list], bool] | None = None) -> list:
    """The replies to ``messages`` that arrived within ``timeout`` seconds (None: until all came), or
    until ``enough`` of the replies so far says they are enough (an over-selected round: ``dropouts``)."""
    waiting = set(grid.push_messages(messages))
    end = None if timeout is None else time.time() + timeout
    replies: list = []
    pause = FIRST_POLL_SECONDS
    while waiting:
        pulled = list(grid.pull_messages(waiting))
        replies.extend(pulled)
        waiting.difference_update(msg.metadata.reply_to_message_id for msg in pulled)
        left = None if end is None else end - time.time()
        if not waiting or (left is not None and left <= 0) or (enough is not None and pulled and enough(replies)):
            break
        time.sleep(pause if left is None else min(pause, left))
        pause = min(pause * 2, MAX_POLL_SECONDS)
    return replies


@contextlib.contextmanager
def bounded_reply_pulls(max_time: float = REPLY_OBJECT_SECONDS) -> Iterator[bool]:
    """Inside the block, the deployed Grid (``http_grid``) pulls one reply's objects for at most
    ``max_time`` seconds; its own ``pull_objects`` is put back after, also on error (``fedmvp.scoped``).
    Yields False (nothing changed) where this Flower's Grid has no module-level ``pull_objects``."""
    try:
        from flwr.superlink.grid import http_grid
    except ImportError:
        yield False
        return
    pull = getattr(http_grid, "pull_objects", None)
    if not callable(pull):
        yield False
        return
    bounded = partial(pull, max_time=max_time, max_tries_per_object=None, initial_backoff=OBJECT_BACKOFF[0],
                      backoff_cap=OBJECT_BACKOFF[1])
    with attribute(http_grid, "pull_objects", bounded):
        yield True
