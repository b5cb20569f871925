"""The `processes` marker check itself (tests/process_markers.py): each kind of lie fails, the truth passes."""

from __future__ import annotations

import pytest

INNER_CONFTEST = """
import pytest
from tests.process_markers import install, pytest_fixture_setup, pytest_runtest_makereport, pytest_runtest_protocol
install()

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:  # as tests/conftest.py does: a deployment test is a processes test
        if item.get_closest_marker("deployment") is not None:
            item.add_marker(pytest.mark.processes)
"""

INNER_TESTS = '''
import subprocess
import pytest

@pytest.fixture(scope="module")
def started():
    subprocess.run(["true"], check=True)
    return "up"

def test_inner_unmarked_starts_one():
    subprocess.run(["true"], check=True)

@pytest.mark.processes
def test_inner_marked_starts_none():
    pass

@pytest.mark.processes
def test_inner_marked_starts_one():
    subprocess.run(["true"], check=True)

@pytest.mark.processes
def test_inner_marked_uses_a_started_fixture(started):
    assert started == "up"

@pytest.mark.processes
def test_inner_marked_uses_the_fixture_set_up_before(started):
    assert started == "up"

def test_inner_unmarked_uses_the_fixture(started):
    assert started == "up"

def test_inner_unmarked_starts_none():
    pass

FEDERATION = ["sh", "-c", "exit 0", "flower-superlink"]  # a command line that reads as a SuperLink

@pytest.mark.processes
def test_inner_processes_only_starts_a_federation():
    subprocess.run(FEDERATION, check=True)

@pytest.mark.deployment
def test_inner_deployment_starts_a_federation():
    subprocess.run(FEDERATION, check=True)

@pytest.mark.deployment
def test_inner_deployment_starts_only_a_command():
    subprocess.run(["true"], check=True)

def federation_exiting(code):
    return ["sh", "-c", f"exit {code}", "flower-superlink"]

@pytest.mark.processes
def test_inner_processes_only_a_refused_federation():
    assert subprocess.run(federation_exiting(2)).returncode == 2

@pytest.mark.deployment
def test_inner_deployment_only_a_refused_federation():
    assert subprocess.run(federation_exiting(2)).returncode == 2

@pytest.mark.deployment
def test_inner_deployment_refused_then_started():
    subprocess.run(federation_exiting(2))
    subprocess.run(FEDERATION, check=True)

@pytest.mark.deployment
def test_inner_deployment_started_then_refused():
    subprocess.run(FEDERATION, check=True)
    subprocess.run(federation_exiting(2))

@pytest.mark.processes
def test_inner_processes_only_a_federation_that_failed():
    assert subprocess.run(federation_exiting(1)).returncode == 1
'''

INNER_SAME_NAME = '''
import pytest

@pytest.fixture(scope="module")
def started():
    return "a fixture of the same name that starts nothing"

def test_inner_other_module_same_fixture_name(started):
    assert started
'''

# (test name, outcome): a fixture that started a process counts for every test that uses it.
ROWS = [
    ("test_inner_unmarked_starts_one", "failed"),
    ("test_inner_marked_starts_none", "failed"),
    ("test_inner_marked_starts_one", "passed"),
    ("test_inner_marked_uses_a_started_fixture", "passed"),
    ("test_inner_marked_uses_the_fixture_set_up_before", "passed"),
    ("test_inner_unmarked_uses_the_fixture", "failed"),
    ("test_inner_unmarked_starts_none", "passed"),
    ("test_inner_other_module_same_fixture_name", "passed"),  # fixtures are told apart by definition, not name
    ("test_inner_processes_only_starts_a_federation", "failed"),
    ("test_inner_deployment_starts_a_federation", "passed"),
    ("test_inner_deployment_starts_only_a_command", "failed"),
    # a federation command that refused (exit 2) started none; one that failed otherwise may have
    ("test_inner_processes_only_a_refused_federation", "passed"),
    ("test_inner_deployment_only_a_refused_federation", "failed"),
    ("test_inner_deployment_refused_then_started", "passed"),
    ("test_inner_deployment_started_then_refused", "passed"),  # not the last command's exit: any started one counts
    ("test_inner_processes_only_a_federation_that_failed", "failed"),
]


@pytest.fixture(scope="module")
def inner_reports(pytester_module) -> dict[str, tuple[str, str]]:
    return pytester_module


@pytest.fixture(scope="module")
def pytester_module(tmp_path_factory):
    """Run the inner tests once, in this process (so this test starts no process itself)."""
    from _pytest.config import main

    root = tmp_path_factory.mktemp("markers")
    (root / "conftest.py").write_text(INNER_CONFTEST)
    (root / "test_inner.py").write_text(INNER_TESTS)
    (root / "test_inner_same_name.py").write_text(INNER_SAME_NAME)
    (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    processes: starts real processes\n"
                                     "    deployment: starts a federation\n")
    reports: dict[str, tuple[str, str]] = {}

    class Collect:
        def pytest_runtest_logreport(self, report):
            if report.when == "call":
                reports[report.nodeid.split("::")[-1]] = (report.outcome, str(report.longrepr or ""))

    from tests.process_markers import LOG

    outer = (LOG.current_test, LOG.fixture_stack, dict(LOG.spawning_fixtures))
    LOG.current_test, LOG.fixture_stack = None, []  # the inner session's starts are its own
    try:
        main([str(root), "-qq", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:benchmark", "--rootdir",
              str(root)], plugins=[Collect()])
    finally:
        LOG.current_test, LOG.fixture_stack, LOG.spawning_fixtures = outer
    return reports


@pytest.mark.parametrize(("name", "outcome"), ROWS)
def test_each_lie_of_the_marker_fails_and_the_truth_passes(inner_reports, name, outcome) -> None:
    got, text = inner_reports[name]
    assert got == outcome, text
    if outcome == "failed":
        assert text.startswith("process markers: ") and name in text
    if name == "test_inner_deployment_only_a_refused_federation":
        assert "every federation command it started refused (exit 2)" in text


@pytest.mark.parametrize(("command", "deployment"), [
    ("/venv/bin/python -m fedmvp_apps.cli serve --config p.toml", True),
    ("/venv/bin/python -m fedmvp_apps.cli join --superlink 127.0.0.1:9092", True),
    ("/venv/bin/fedmvp train --config p.toml --run-dir run", True),
    ("/venv/bin/python -m fedmvp_apps.cli demo --rounds 12", True),
    ("/venv/bin/edge-client join --superlink 127.0.0.1:9092", True),
    ("/venv/bin/python -m benchmarks poison --quick --json", True),
    ("/venv/bin/flower-superlink --insecure", True),
    ("/venv/lib/ray/core/src/ray/gcs/gcs_server --gcs_server_port=0", True),
    ("/venv/bin/python -c from fedmvp.federated.simulation import simulate\nsimulate(run)", True),
    ("/venv/bin/python tests/concurrency/paused.py gate save@2 fedmvp train --config p.toml", True),  # wrapped
    ("/venv/bin/python -m fedmvp_apps.cli ingest --run run u.safetensors", False),
    ("/venv/bin/edge-client train --data local", False),
    ("/venv/bin/fedmvp-export --run run --round 2", False),
    ("/venv/bin/python -m mkdocs build --strict", False),
    ("g++ -O2 consumer.cpp", False),
    ("/venv/bin/python -m fedmvp_apps.deploy.superlink_process --host 127.0.0.1", True),
    ("/venv/bin/python -m fedmvp_apps.deploy.serverapp_process --token-stdin", False),
])
def test_what_counts_as_starting_a_federation(command, deployment) -> None:
    from tests.process_markers import is_deployment

    assert is_deployment(command) is deployment
