"""``Grid.send_and_receive`` with a short poll: push a round's messages, then pull replies until all
came or the round timeout passed.

Flower 1.42's deployment Grid (``flwr.superlink.grid.http_grid``) sleeps a fixed 3 s between two
pulls of the replies, so a deployed round waits 1.5 s on average after its last reply, twice a
round (train, evaluate): issue 24 §5, the deploy benchmark. Here the wait starts at
``FIRST_POLL_SECONDS`` and grows to at most ``MAX_POLL_SECONDS`` (one small Runtime API request on
the server's own SuperLink each time). The replies are the same ones Flower's method returns;
their order may differ, and the strategy sorts them before it averages (docs/method.md).
"""

from __future__ import annotations

import time
from typing import Iterable

FIRST_POLL_SECONDS = 0.05
MAX_POLL_SECONDS = 0.25  # Flower: 3 s


def send_and_receive(grid, messages: Iterable, timeout: float | None) -> list:
    """The replies to ``messages`` that arrived within ``timeout`` seconds (None: until all came)."""
    waiting = set(grid.push_messages(messages))
    end = None if timeout is None else time.time() + timeout
    replies: list = []
    pause = FIRST_POLL_SECONDS
    while waiting:
        pulled = list(grid.pull_messages(waiting))
        replies.extend(pulled)
        waiting.difference_update(msg.metadata.reply_to_message_id for msg in pulled)
        left = None if end is None else end - time.time()
        if not waiting or (left is not None and left <= 0):
            break
        time.sleep(pause if left is None else min(pause, left))
        pause = min(pause * 2, MAX_POLL_SECONDS)
    return replies
