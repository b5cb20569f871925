"""The `processes` marker tells the truth: a test that starts a process carries it, and one that carries it
starts one (docs/testing.md, Markers).

An audit hook (PEP 578) sees every process this interpreter starts: `subprocess.Popen` (Ray, Flower's
SuperLink and SuperNodes, our own commands), `os.posix_spawn`, `os.system`, and a bare `os.fork`. A fork
made by `multiprocessing` (the synthetic world's render pool) is not counted: it is one function's worker
pool of this interpreter, ended before that function returns; nor is `platform`'s `uname -p` query.
Events are charged to the test being set up, run or torn down, and to the fixture being set up, so a test that
uses a fixture which started a deployment counts as starting it even when another test set the fixture up
first.

A federation command that exits 2 (our commands' code for bad input, refused before anything starts:
`fedmvp serve` on a port in use, `fedmvp join` of a bad site folder) started no federation: a test whose
federation commands all refused is a `processes` test, not a `deployment` (it takes seconds on the other
worker). Its exit code is read from the command's ``Popen`` once the test is over.

The hooks below are imported by tests/conftest.py; a violation turns the test's report into a failure
that names the test and what it started (or that it started nothing).
"""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

SPAWN_EVENTS = frozenset({"subprocess.Popen", "os.posix_spawn", "os.posix_spawnp", "os.system", "os.fork",
                          "os.forkpty"})
MARKER = "processes"
DEPLOYMENT = "deployment"

# What starts a federation (docs/testing.md, Markers): a word of the command that says so. Flower's own
# executables and our wrappers of them (fedmvp_apps.deploy.superlink_process, supernode_process), `fedmvp
# serve`, `fedmvp join` and `edge-client join` (a SuperNode each), Ray's head processes (what `ray.init`
# starts), the commands that start a Ray simulation (`fedmvp train`, `fedmvp demo`, a `-c` script calling
# `simulate(`), and a benchmark section run as `python -m benchmarks`.
DEPLOYMENT_WORDS = ("flower-superlink", "flower-supernode", "superlink_process", "supernode_process", "gcs_server",
                    "raylet", "simulate(")
DEPLOYMENT_COMMANDS = {"serve", "join", "train", "demo"}  # of fedmvp; of edge-client only join
DEPLOYMENT_TAG = "federation: "  # how a recorded start that is a deployment is shown
REFUSED = 2  # the exit code of our commands' refusals: bad input, nothing started


class SpawnLog:
    """What processes were started, charged to the current test and the fixture being set up."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.current_test: str | None = None
        self.by_test: dict[str, list[str]] = {}
        self.fixture_stack: list[int] = []  # id() of each FixtureDef being set up
        self.spawning_fixtures: dict[int, str] = {}  # id(FixtureDef) -> the first thing it started
        self.federations: dict[str, list[subprocess.Popen]] = {}  # test -> its federation commands' Popens

    def record(self, what: str) -> None:
        with self.lock:
            if self.current_test is not None:
                self.by_test.setdefault(self.current_test, []).append(what)
            for fixture in self.fixture_stack:
                self.spawning_fixtures.setdefault(fixture, what)

    def started_federation(self, proc: subprocess.Popen) -> None:
        with self.lock:
            if self.current_test is not None and not self.fixture_stack:
                self.federations.setdefault(self.current_test, []).append(proc)

    def refused(self, test: str) -> int:
        """How many of ``test``'s own federation commands exited ``REFUSED`` (the rest may have run one)."""
        return sum(proc.poll() == REFUSED for proc in self.federations.get(test, []))


LOG = SpawnLog()


NOT_COUNTED = ("multiprocessing", "platform")  # a function's own worker pool; platform's `uname -p` query


def _from_module_not_counted() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith(NOT_COUNTED):
            return True
        frame = frame.f_back
    return False


def _describe(event: str, args: tuple) -> str:
    """The whole command line (judged whole; shown cut to 160 characters)."""
    if event == "subprocess.Popen" and len(args) > 1:
        command = args[1]
        words = [str(part) for part in (command if isinstance(command, (list, tuple)) else [command])]
        return " ".join(words)
    if event in ("os.posix_spawn", "os.posix_spawnp") and args:
        return f"{event} {args[0]}"
    if event == "os.system" and args:
        return f"os.system {str(args[0])[:120]}"
    return event


def is_deployment(command: str) -> bool:
    """Does this command line start a federation (a SuperLink, SuperNodes, Ray) or a benchmark section?"""
    words = command.split()
    if any(word in command for word in DEPLOYMENT_WORDS) or "benchmarks" in words[:3]:
        return True
    for i, word in enumerate(words):  # anywhere: a wrapper (tests/concurrency/paused.py) runs the command after its own
        name = word.rsplit("/", 1)[-1]
        following = words[i + 1] if i + 1 < len(words) else ""
        if name in ("fedmvp", "fedmvp_apps.cli") and following in DEPLOYMENT_COMMANDS:
            return True
        if name in ("edge-client", "fedmvp_apps.edge_cli") and following == "join":
            return True
    return False


def _audit(event: str, args: tuple) -> None:
    if event not in SPAWN_EVENTS:
        return
    if _from_module_not_counted():
        return
    command = _describe(event, args)
    LOG.record(f"{DEPLOYMENT_TAG}{command[:160]}" if is_deployment(command) else command[:160])


_installed = False


def _keep_federation_popens(init):
    def keeping(self, *args, **kwargs):
        init(self, *args, **kwargs)
        command = self.args if isinstance(self.args, (list, tuple)) else [self.args]
        if is_deployment(" ".join(map(str, command))):
            LOG.started_federation(self)
    return keeping


def install() -> None:
    """Add the audit hook once per interpreter (hooks cannot be removed; a second is never added), and
    keep the ``Popen`` of each federation command, whose exit code says whether it refused."""
    global _installed
    if not _installed:
        sys.addaudithook(_audit)
        subprocess.Popen.__init__ = _keep_federation_popens(subprocess.Popen.__init__)
        _installed = True


def started_by(item: pytest.Item) -> list[str]:
    """Everything ``item`` started itself, then the first thing each of its spawning fixtures started."""
    own = list(LOG.by_test.get(item.nodeid, []))
    info = getattr(item, "_fixtureinfo", None)
    visible = info.name2fixturedefs.items() if info is not None else ()
    fixtures = [f"fixture {name}: {LOG.spawning_fixtures[id(d)]}" for name, defs in visible for d in defs
                if id(d) in LOG.spawning_fixtures]
    return own + fixtures


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    LOG.fixture_stack.append(id(fixturedef))
    try:
        yield
    finally:
        LOG.fixture_stack.pop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    LOG.current_test = item.nodeid
    try:
        yield
    finally:
        LOG.current_test = None


def verdict(item: pytest.Item) -> str | None:
    """The markers' lie, if any, in one line. ``deployment`` implies ``processes`` (tests/conftest.py)."""
    started = started_by(item)
    own = LOG.by_test.get(item.nodeid, [])
    refused = LOG.refused(item.nodeid)
    # the federations the test itself started that did not refuse, and those of the fixtures it uses
    own_deployments = [what for what in own if DEPLOYMENT_TAG in what]
    deployments = own_deployments[:max(0, len(own_deployments) - refused)] + \
        [what for what in started[len(own):] if DEPLOYMENT_TAG in what]
    marked = item.get_closest_marker(MARKER) is not None
    deployment = item.get_closest_marker(DEPLOYMENT) is not None
    if started and not marked:
        return (f"{item.nodeid} starts a process but is not marked `{MARKER}` (the quick loop would run it): "
                f"{started[0]}")
    if marked and not started:
        return (f"{item.nodeid} is marked `{MARKER}` but started no process: take the mark off this test "
                "(mark the tests that start processes one by one, not the whole module)")
    if deployments and not deployment:
        return (f"{item.nodeid} starts a federation but is not marked `{DEPLOYMENT}` (it would compete with "
                f"another deployment for the cores): {deployments[0]}")
    if deployment and not deployments:
        why = f"every federation command it started refused (exit {REFUSED})" if refused else \
            "started no SuperLink, SuperNode, Ray or benchmark section"
        return f"{item.nodeid} is marked `{DEPLOYMENT}` but {why}; mark it `{MARKER}` only"
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.passed:
        return
    problem = verdict(item)
    if problem is not None:
        report.outcome = "failed"
        report.longrepr = f"process markers: {problem}"
