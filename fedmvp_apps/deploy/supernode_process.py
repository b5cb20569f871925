"""The SuperNode process of `fedmvp join` and `edge-client join`: Flower's own ``flower-supernode``,
with its main loop's two fixed waits shortened.

Flower 1.42's SuperNode loop (``flwr.supernode.start_client_internal``) sleeps 3 s after every
empty pull from the SuperLink and polls its own state every 0.5 s for the ClientApp's reply; it has
no flag for either. A message therefore waits 1.5 s on average before the node even sees it, and
a reply up to 0.5 s before it is sent: with two messages a round (train, evaluate) about 3.5 s of
a steady round on 127.0.0.1 that no training needs (issue 24 §5, the deploy benchmark). This
entry point gives that module a ``time`` whose ``sleep`` waits at most ``IDLE_PULL_SECONDS``
between pulls (one small HTTPS request per node each time: 2 a second) and ``LOCAL_POLL_SECONDS``
for anything shorter (local state only), and its pulls of a message's objects, which find them
still on their way to the SuperLink and back off from 1 s, a short backoff (``OBJECT_BACKOFF``);
then it runs Flower's command unchanged.

``python -m fedmvp_apps.deploy.supernode_process ARGS`` takes exactly ``flower-supernode``'s
arguments. Where the Flower found no longer has those waits (another version), the loop runs as
Flower wrote it, with one warning line: slower, never wrong. Imports neither ``fedmvp`` nor torch.
"""

from __future__ import annotations

import inspect
import sys
import time
from functools import partial
from types import ModuleType

OBJECT_BACKOFF = (0.02, 0.5)  # Flower: 1 s, doubling to 10 s, while a message's objects reach the SuperLink
IDLE_PULL_SECONDS = 0.5  # Flower: 3 s between two empty pulls from the SuperLink
LOCAL_POLL_SECONDS = 0.05  # Flower: 0.5 s between two looks at the node's own state (a reply, an object)
FLOWER_WAITS = ("time.sleep(3)", "time.sleep(0.5)")  # in flwr 1.42's start_client_internal


class PacedTime:
    """The ``time`` module, except that ``sleep`` is capped (Flower's loop only calls the waits above)."""

    def __init__(self, idle: float = IDLE_PULL_SECONDS, local: float = LOCAL_POLL_SECONDS) -> None:
        self.idle, self.local = idle, local

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, self.idle if seconds >= 1.0 else self.local))

    def __getattr__(self, name: str):
        return getattr(time, name)


def pace(loop: ModuleType) -> bool:
    """Give Flower's SuperNode loop module the paced clock; False (nothing changed) where its waits
    are not the ones this was written for."""
    try:
        source = inspect.getsource(loop)
    except (OSError, TypeError):
        return False
    if getattr(loop, "time", None) is not time or not all(wait in source for wait in FLOWER_WAITS):
        return False
    loop.time = PacedTime()
    if callable(getattr(loop, "pull_objects", None)):
        loop.pull_objects = partial(loop.pull_objects, max_tries_per_object=None, initial_backoff=OBJECT_BACKOFF[0],
                                    backoff_cap=OBJECT_BACKOFF[1])
    return True


def main() -> None:
    import importlib

    loop = importlib.import_module("flwr.supernode.start_client_internal")
    if not pace(loop):
        print("fedmvp supernode: warning: this Flower's SuperNode loop is not flwr 1.42's; it runs with "
              "Flower's own waits (3 s between pulls)", file=sys.stderr, flush=True)
    from flwr.supernode.cli.flower_supernode import flower_supernode

    sys.argv[0] = "flower-supernode"
    flower_supernode()


if __name__ == "__main__":
    main()
