"""The SuperNode process of `fedmvp join` and `edge-client join`: Flower's own ``flower-supernode``,
with its main loop's two fixed waits shortened.

Flower 1.42's SuperNode loop (``flwr.supernode.start_client_internal``) sleeps 3 s after every
empty pull from the SuperLink and polls its own state every 0.5 s for the ClientApp's reply; it has
no flag for either. A message therefore waits 1.5 s on average before the node even sees it, and
a reply up to 0.5 s before it is sent: with two messages a round (train, evaluate) about 3.5 s of
a steady round on 127.0.0.1 that no training needs (measured by the deploy benchmark, docs/benchmarks.md "deploy"). This
entry point gives that module a ``time`` whose ``sleep`` waits ``LOCAL_POLL_SECONDS`` for anything
shorter than 1 s (local state only) and, between two empty pulls from the SuperLink, a pause that
grows with the time since this node last sent a reply: the next round's message usually follows a
reply within a second (the server aggregates), so right after one the node looks every
``FIRST_PULL_SECONDS``, then ever less often, at most ``IDLE_PULL_SECONDS`` apart when idle or busy
training (one small HTTPS request per node each time, and a run check beside it). Every connected node
pays the SuperLink that, whether or not it has work: at 0.5 s apart, 50 devices' pulls and run checks
took a core of the SuperLink's machine and the fleet stalled (docs/benchmarks.md, "Fleets"); 2 s apart
a message to a node idle for seconds waits 1 s on average, and a node that replied under a second ago
still looks within half that time. Its pulls of a message's objects, which find
them still on their way to the SuperLink and back off from 1 s, get a short backoff
(``OBJECT_BACKOFF``). Then it runs Flower's command unchanged.

Its heartbeat says every few seconds that it is alive, promising the next within
``HEARTBEAT_SECONDS`` (Flower's least, 10 s; Flower sends 30 s). The SuperLink takes a node that missed
two promises for gone: it answers the node's messages with ``Node Unavailable``, so a round waiting for a
site whose machine died closes with the others' replies 20 s later instead of 60 s, and a site started
again after its machine died is admitted again as soon (the SuperLink refuses a key it still holds
online). A heartbeat is one small request; a node already asks for work every ``IDLE_PULL_SECONDS``.

Its reconnection to a SuperLink that went away waits at most ``RECONNECT_SECONDS`` between tries
(Flower: up to 20 s), so a `fedmvp serve` stopped and started again has its nodes back within
seconds (``cap_reconnect``).

One fix besides (``release_ended_runs``): a message whose run ends while its objects are pulled
raised Flower's ``RunNotRunningException``, a ``BaseException``, past the loop's ``except Exception``
that deletes the message and fails its task; the task was left pending with a message whose
objects never come, and the warm executor that claimed it waited on them (2 hours, Flower's bound)
instead of running the next run's messages: the flake of `fedmvp serve` killed and restarted
(tests/federated/test_faults.py). Here that ending reaches the loop as an ordinary error, so Flower
deletes the message and fails the task, which revokes its token and ends the executor's task.

It also leaves when the run it served ends (``leave_ended_runs``): Flower's SuperNode would poll the
SuperLink forever. Between two empty pulls, at most every ``RUN_CHECK_SECONDS``, it asks the
SuperLink for the last run it received a message of (Flower's Fleet ``GetRun``, refused once the
run is no longer running); refused, it prints one line (``run R ended on the server; leaving``) and
exits 0, deactivating the node as Flower does on its way out; it takes the end once the SuperLink
still says so ``RUN_END_CONFIRM`` seconds later, so a `fedmvp serve` interrupted (it stops its run, then
its SuperLink at once; the same command resumes the run) keeps its sites. A run whose SuperLink was lost since
(a `fedmvp serve` killed and started again, whose restarted SuperLink reports the old run
finished) is not taken for an end: the node stays for the run the restarted server submits.
`fedmvp serve` keeps its SuperLink up ``RUN_END_NOTICE`` seconds after its run ended, so its
nodes hear it (fedmvp_apps/deploy/superlink.py).

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
IDLE_PULL_SECONDS = 2.0  # Flower: 3 s between two empty pulls from the SuperLink
FIRST_PULL_SECONDS = 0.05  # right after a reply: the next message is on its way
LOCAL_POLL_SECONDS = 0.05  # Flower: 0.5 s between two looks at the node's own state (a reply, an object)
RECONNECT_SECONDS = 4.0  # Flower: MAX_RETRY_DELAY, 20 s, between two tries to reach the SuperLink
HEARTBEAT_SECONDS = 10  # Flower: 30 s (HEARTBEAT_DEFAULT_INTERVAL), at least 10 s (HEARTBEAT_MIN_INTERVAL)
RUN_CHECK_SECONDS = 0.5  # between two asks whether the node's run still runs (while idle)
RUN_END_CONFIRM = 1.5  # a run's end is taken once the SuperLink still says so this much later
MARK = "[fedmvp] "  # our line among Flower's (fedmvp_apps.deploy.node_lines.MARK)
FLOWER_WAITS = ("time.sleep(3)", "time.sleep(0.5)")  # in flwr 1.42's start_client_internal


class PacedTime:
    """The ``time`` module, except for ``sleep`` (Flower's loop only calls the waits above): a wait
    under 1 s is a look at local state (``local``); a longer one, between two empty pulls, lasts half
    the time since the last reply (``replied``), within ``first`` .. ``idle``."""

    def __init__(self, idle: float = IDLE_PULL_SECONDS, local: float = LOCAL_POLL_SECONDS,
                 first: float = FIRST_PULL_SECONDS, clock=time.monotonic, wait=time.sleep) -> None:
        self.idle, self.local, self.first, self.clock, self.wait = idle, local, first, clock, wait
        self.last_reply = float("-inf")

    def replied(self) -> None:
        """A reply was just sent: the next message is likely soon."""
        self.last_reply = self.clock()

    def pause(self, seconds: float) -> float:
        if seconds < 1.0:
            return min(seconds, self.local)
        return min(seconds, self.idle, max(self.first, (self.clock() - self.last_reply) / 2))

    def sleep(self, seconds: float) -> None:
        self.wait(self.pause(seconds))

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
    paced = loop.time = PacedTime()
    push = getattr(loop, "_push_messages", None)
    if callable(push):
        def push_then_pace(*args, **kwargs):
            try:
                return push(*args, **kwargs)
            finally:
                paced.replied()
        loop._push_messages = push_then_pace
    if callable(getattr(loop, "pull_objects", None)):
        loop.pull_objects = partial(loop.pull_objects, max_tries_per_object=None, initial_backoff=OBJECT_BACKOFF[0],
                                    backoff_cap=OBJECT_BACKOFF[1])
    return True


class RunEnded(RuntimeError):
    """The run of a message being received ended (Flower's RunNotRunningException, as an Exception)."""


def release_ended_runs(loop: ModuleType) -> bool:
    """Make a run that ends while its message's objects are pulled an ordinary error of that pull (see
    above); False (nothing changed) where this Flower's loop has no ``_pull_and_store_message``."""
    receive = getattr(loop, "_pull_and_store_message", None)
    ended = getattr(loop, "RunNotRunningException", None)
    if not callable(receive) or not isinstance(ended, type):
        return False

    def as_error(call):
        def guarded(*args, **kwargs):
            try:
                return call(*args, **kwargs)
            except ended as err:
                raise RunEnded(f"its run is no longer running ({err or 'ended'})") from None
        return guarded

    def pull_and_store_message(*args, **kwargs):
        for name in ("pull_object", "confirm_message_received"):  # only called once the task exists
            if callable(kwargs.get(name)):
                kwargs[name] = as_error(kwargs[name])
        return receive(*args, **kwargs)

    loop._pull_and_store_message = pull_and_store_message
    return True


class RunWatch:
    """The last run this node received a message of, and whether the SuperLink was lost since. A run
    found ended is left only once the SuperLink still says so ``confirm`` seconds later: `fedmvp serve`
    interrupted (resumable: its sites stay) stops its run and then its SuperLink at once, while a run
    that ended for good keeps the SuperLink up longer (superlink.RUN_END_NOTICE)."""

    def __init__(self, every: float = RUN_CHECK_SECONDS, confirm: float = RUN_END_CONFIRM, clock=time.monotonic,
                 leave=None) -> None:
        self.every, self.confirm, self.clock, self.leave = every, confirm, clock, leave
        self.run_id: int | None = None
        self.lost = False
        self.checked = float("-inf")
        self.ended_at: float | None = None

    def seen(self, run_id: int) -> None:
        self.run_id, self.lost, self.ended_at = run_id, False, None

    def idle(self, get_run, ended: type) -> None:
        """Between two empty pulls: ask whether the run still runs; its end ends this process."""
        if self.run_id is None or self.lost or self.clock() - self.checked < self.every:
            return
        self.checked = self.clock()
        try:
            get_run(self.run_id)
            self.ended_at = None
            return
        except ended:
            pass
        if self.lost:  # refused by a SuperLink we reconnected to: not the run we served ending
            return
        if self.ended_at is None:
            self.ended_at = self.checked
        if self.checked - self.ended_at >= self.confirm:
            print(f"{MARK}run {self.run_id} ended on the server; leaving", flush=True)
            if self.leave is not None:
                self.leave()  # Flower's own exit: its servers stopped, the node deactivated, a bounded wait
            raise SystemExit(0)


def leave_ended_runs(loop: ModuleType, watch: RunWatch) -> bool:
    """Watch the runs of the loop's messages (``watch``); False where this Flower's loop differs."""
    receive = getattr(loop, "_pull_and_store_message", None)
    ended = getattr(loop, "RunNotRunningException", None)
    if not callable(receive) or not isinstance(ended, type):
        return False

    def pull_and_store_message(*args, **kwargs):
        run_id = receive(*args, **kwargs)
        if run_id is not None:
            watch.seen(run_id)
        elif callable(kwargs.get("get_run")):
            watch.idle(kwargs["get_run"], ended)
        return run_id

    loop._pull_and_store_message = pull_and_store_message
    return True


def cap_reconnect(watch: RunWatch | None = None) -> bool:
    """Cap the wait between two tries to reach the SuperLink (Flower's HTTP retry policy reads
    ``MAX_RETRY_DELAY`` from its module when it builds one); False where this Flower has no such policy."""
    import importlib

    try:
        retry = importlib.import_module("flwr.supercore.retry.http_retry")
    except ImportError:
        return False
    if not isinstance(getattr(retry, "MAX_RETRY_DELAY", None), (int, float)):
        return False
    retry.MAX_RETRY_DELAY = min(retry.MAX_RETRY_DELAY, RECONNECT_SECONDS)
    flower_log = getattr(retry, "log", None)
    if watch is not None and callable(flower_log):  # a failed try: the SuperLink was lost (RunWatch.lost)
        def log(level, message, *args, **kwargs):
            if str(message).startswith("Connection attempt failed"):
                watch.lost = True
            return flower_log(level, message, *args, **kwargs)
        retry.log = log
    return True


def beat_sooner(seconds: float = HEARTBEAT_SECONDS) -> bool:
    """Promise (and send) the node's heartbeats ``seconds`` apart instead of Flower's 30 s: both the
    connection (its promise to the SuperLink) and the sender (its pace) read the interval from their
    module when they use it. False (nothing changed) where this Flower reads it elsewhere."""
    import importlib

    try:
        modules = [importlib.import_module(name) for name in ("flwr.supernode.fleet_http_connection",
                                                              "flwr.supercore.heartbeat")]
        from flwr.common.constant import HEARTBEAT_MIN_INTERVAL
    except ImportError:
        return False
    if not all(isinstance(getattr(m, "HEARTBEAT_DEFAULT_INTERVAL", None), (int, float)) for m in modules):
        return False
    for module in modules:
        module.HEARTBEAT_DEFAULT_INTERVAL = max(seconds, HEARTBEAT_MIN_INTERVAL)
    return True


def main() -> None:
    import importlib

    loop = importlib.import_module("flwr.supernode.start_client_internal")
    release_ended_runs(loop)
    from flwr.supercore.exit import ExitCode, flwr_exit

    watch = RunWatch(leave=lambda: flwr_exit(ExitCode.SUCCESS))
    leave_ended_runs(loop, watch)
    cap_reconnect(watch)
    beat_sooner()
    if not pace(loop):
        print("fedmvp supernode: warning: this Flower's SuperNode loop is not flwr 1.42's; it runs with "
              "Flower's own waits (3 s between pulls)", file=sys.stderr, flush=True)
    from flwr.supernode.cli.flower_supernode import flower_supernode

    sys.argv[0] = "flower-supernode"
    flower_supernode()


if __name__ == "__main__":
    main()
