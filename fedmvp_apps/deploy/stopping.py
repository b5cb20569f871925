"""How `fedmvp serve`, `fedmvp join` and `edge-client join` stop: within ``STOP_BOUND`` seconds of
Ctrl-C, SIGTERM or SIGHUP (an operator's SSH session closing), with one line, and no process of theirs
left running (docs/tutorials/across-machines.md, "Stopping"). `fedmvp train` and `fedmvp demo`, whose
rounds run in Flower's simulation engine, end at once instead (`end_at_signal`).

A signal only sets an event (`Stopper`): raising KeyboardInterrupt wherever the main thread happens
to be can leave a library's lock held, or a wait on a child unbounded, so a stop that follows can
hang (a `fedmvp serve` once printed nothing after its SuperLink shut down and outlived its 90 s).
The command's own loop sees the event at its next look and stops in order: every wait of that
order has a deadline counted from the signal (`Stopper.left`). Should the order still not end in
time, a watchdog thread started by the signal kills every descendant, prints the line and ends
the process: the bound holds whatever blocks. Descendants are found through ``/proc`` (Linux), so
a grandchild (the ServerApp a SuperExec started) is not left behind either. Imports neither
``fedmvp`` nor torch (an edge device runs it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

STOP_BOUND = 15.0  # seconds from the signal to the command's exit, whatever blocks
ORDERLY = 11.0  # the orderly stop's share; then SIGKILL, and the watchdog at STOP_BOUND - 1
NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}


@contextlib.contextmanager
def end_at_signal(last_words: Callable[[int], str]) -> Iterator[None]:
    """Inside the block, SIGINT, SIGTERM and SIGHUP print ``last_words(signum)`` (one line), kill every
    descendant (Ray's cluster) and end this process with 128 + the signal's number; the handlers before
    are put back after (a test's process keeps its own). For a command whose work cannot be stopped in
    order from outside (a simulation's rounds run in Flower's threads and Ray's processes: raising
    KeyboardInterrupt there left a thread that kept the process alive) and whose results are safe at any
    instant (every round is written whole, atomically, and a run resumes from the last). A thread does
    the ending, so the handler returns at once. Inside the block nothing else may take these signals over
    (``signal.signal`` keeps ours: Ray's driver sets SIGTERM to ``sys.exit``, which raised in the main thread
    and left Flower's thread holding the process). Outside the main thread (no signals there) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def end(signum: int) -> None:
        try:  # on a line of its own: a progress bar may hold the line
            print("\n" + last_words(signum), file=sys.stderr, flush=True)
        finally:
            kill_tree(os.getpid())
            os._exit(128 + signum)

    def handle(signum: int, _frame) -> None:
        threading.Thread(target=end, args=(signum,), daemon=True, name="end-at-signal").start()

    previous = {sig: signal.signal(sig, handle) for sig in NAMES}
    set_handler = signal.signal

    def keep_ours(sig, handler):  # ray.init sets SIGTERM to sys.exit, which would leave the process hanging
        if sig in NAMES:
            return handle
        return set_handler(sig, handler)

    signal.signal = keep_ours  # type: ignore[assignment]
    try:
        yield
    finally:
        signal.signal = set_handler  # type: ignore[assignment]
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def interrupt_at_signal() -> Iterator[dict[str, int]]:
    """Inside the block SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread, as Ctrl-C does, so a
    command whose work is its own Python code (an export) cleans up the one way, whatever stopped it; the
    dict gets ``signum``, the signal heard. The handlers before are put back after."""
    heard: dict[str, int] = {"signum": signal.SIGINT}
    if threading.current_thread() is not threading.main_thread():
        yield heard
        return

    def handle(signum: int, _frame) -> None:
        heard["signum"] = signum
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, handle) for sig in NAMES}
    try:
        yield heard
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Interrupted(Exception):
    """The command was told to stop (SIGINT or SIGTERM); ``str`` is the one line it prints."""


class Stopper:
    """SIGINT and SIGTERM set ``event``; ``check`` and ``sleep`` turn it into `Interrupted` where the
    command can stop in order. ``last_words`` is what the watchdog prints if the order overruns."""

    def __init__(self, last_words: str = "stopped") -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        self.at = 0.0
        self.last_words = last_words
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "Stopper":
        for sig in NAMES:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def name(self) -> str:
        return NAMES.get(self.signum, "a signal") if self.signum is not None else "nothing"

    def _handle(self, signum: int, _frame) -> None:
        if self.event.is_set():  # a second Ctrl-C: the stop under way already has its bound
            return
        self.signum, self.at = signum, time.monotonic()
        self.event.set()
        threading.Thread(target=self._watchdog, daemon=True, name="stop-watchdog").start()

    def _watchdog(self) -> None:
        time.sleep(max(0.0, STOP_BOUND - 1.0 - (time.monotonic() - self.at)))
        kill_tree(os.getpid())
        try:
            print(f"{self.last_words} (the orderly stop overran {STOP_BOUND - 1:g} s: killed)", file=sys.stderr,
                  flush=True)
        finally:
            os._exit(1)

    def left(self, share: float = ORDERLY) -> float:
        """Seconds left of the orderly stop (``share`` seconds after the signal); before any signal, ``share``."""
        if not self.event.is_set():
            return share
        return max(0.0, share - (time.monotonic() - self.at))

    def check(self) -> None:
        if self.event.is_set():
            raise Interrupted(self.name)

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds``, or until told to stop (then `Interrupted`)."""
        self.event.wait(seconds)
        self.check()


def run_interruptible(args: list[str], stopper: Stopper | None, timeout: float, **popen) -> subprocess.CompletedProcess:
    """``subprocess.run(args, capture_output=True, text=True, timeout=timeout)`` that a stop ends at
    once (the child killed, `Interrupted` raised) instead of at its timeout."""
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen) as proc:
        deadline = time.monotonic() + timeout
        while True:
            try:
                out, err = proc.communicate(timeout=0.2)
                return subprocess.CompletedProcess(args, proc.returncode, out, err)
            except subprocess.TimeoutExpired:
                if (stopper is not None and stopper.event.is_set()) or time.monotonic() > deadline:
                    proc.kill()
                    proc.communicate()
                    if stopper is not None:
                        stopper.check()
                    raise subprocess.TimeoutExpired(args, timeout) from None


def _table() -> dict[int, tuple[int, str]]:
    """Every running process's parent and start time (``/proc/PID/stat`` fields 4 and 22; a zombie has
    ended and is left out); {} without ``/proc``."""
    table: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z":
                table[int(entry.name)] = (int(fields[1]), fields[19])
    return table


def descendants(pid: int) -> dict[int, str]:
    """Every living descendant of ``pid`` with its start time (so a pid reused later is not mistaken for it)."""
    table = _table()
    found: dict[int, str] = {}
    frontier = {pid}
    while frontier:
        children = {child for child, (parent, _) in table.items() if parent in frontier and child not in found}
        found.update({child: table[child][1] for child in children})
        frontier = children
    return found


def signal_pids(pids: dict[int, str], sig: int) -> None:
    """Send ``sig`` to each of ``pids`` that is still the process it was (same start time)."""
    table = _table()
    for pid, started in pids.items():
        if pid in table and table[pid][1] == started:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def kill_pids(pids: dict[int, str]) -> None:
    signal_pids(pids, signal.SIGKILL)


def alive(pids: dict[int, str]) -> bool:
    """Whether any of ``pids`` still runs as the process it was (same start time)."""
    table = _table()
    return any(pid in table and table[pid][1] == started for pid, started in pids.items())


def kill_tree(pid: int) -> None:
    """SIGKILL every descendant of ``pid`` (not ``pid`` itself)."""
    kill_pids(descendants(pid))


def stop_processes(procs: list[subprocess.Popen], within: float) -> None:
    """SIGTERM each of ``procs`` and whatever they started at once (a ServerApp stops in about 4 s,
    Flower's force-exit bound, whether its SuperLink still runs or not), wait for them together up to
    ``within`` seconds, then SIGKILL what is left (a grandchild would otherwise outlive its parent)."""
    family: dict[int, str] = {}
    for proc in procs:
        if proc.poll() is None:
            family.update(descendants(proc.pid))
    for proc in procs:
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    signal_pids(family, signal.SIGTERM)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and (any(proc.poll() is None for proc in procs) or alive(family)):
        time.sleep(0.05 if any(proc.poll() is None for proc in procs) else 0.2)
    for proc in procs:
        if proc.poll() is None:
            family.update(descendants(proc.pid))
            proc.kill()
    kill_pids(family)
    for proc in procs:
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:  # not reaped in time (a process stuck in the kernel): leave it
            pass
