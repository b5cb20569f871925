"""Another local user of a deployment's machine reads every command line (`ps`, ``/proc/PID/cmdline``):
each process our launches start gets its secrets by a 0600 file's path or a pipe, never as a value on
its command line or in its environment (docs/security.md, the row of another local user). One row per
launch; `tests/federated/test_lifecycle.py` reads ``/proc`` of a whole deployment in mid-round."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.deadlines import scaled
from tests.federated.processes import ENV


TOKEN = "ab" * 128  # a Flower task token: token_hex(128)


def _spec(**changes):
    from flwr.supercore.constant import TaskType
    from flwr.supercore.superexec.executor import ExecutionSpec

    fields = dict(task_type=TaskType.SERVER_APP, runtime_api_address="127.0.0.1:9092", token=TOKEN, insecure=False,
                  root_certificates_path="/certs/ca.crt", runtime_dependency_install=False, parent_pid=7,
                  suppress_output=True, task_id=1)
    return ExecutionSpec(**{**fields, **changes})


class _Recorder:
    """Stands in for subprocess.Popen: what was started, and what its stdin received."""

    started: list = []

    def __init__(self, args, **kwargs):
        self.args, self.kwargs, self.written = args, kwargs, b""
        self.stdin = self
        _Recorder.started.append(self)

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        pass


def _serverapp_launch(monkeypatch) -> _Recorder:
    from fedmvp_apps.deploy import superexec_process

    _Recorder.started = []
    monkeypatch.setattr(superexec_process.subprocess, "Popen", _Recorder)
    result = superexec_process.token_on_stdin_executor().launch(_spec())
    assert result.status == "accepted"
    return _Recorder.started[0]


def _supernode_args(tmp_path: Path) -> list[str]:
    from fedmvp_apps.deploy.supernode import supernode_command

    key = tmp_path / "node-0"
    key.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nQk9ESUVT-private\n")
    return supernode_command("127.0.0.1:9092", "partition-id=0", root_certificates=key, auth_key=key)


@pytest.mark.parametrize("launch", ["serverapp", "supernode"])
def test_no_launch_puts_a_secret_on_a_command_line(tmp_path, monkeypatch, launch):
    if launch == "serverapp":
        started = _serverapp_launch(monkeypatch)
        args, secret = started.args, TOKEN
        assert "--token-stdin" in args and started.written == (TOKEN + "\n").encode()  # the pipe carries it
        assert "env" not in started.kwargs  # the SuperExec's own environment: no token in it
    else:
        args, secret = _supernode_args(tmp_path), "Qk9ESUVT-private"
        assert str(tmp_path / "node-0") in args  # the key by its path
    assert not any(secret in arg for arg in args), args


@pytest.mark.processes  # starts real processes (see pyproject.toml markers)
@pytest.mark.parametrize("stdin", ["", "guess\n", TOKEN + TOKEN + "\n"], ids=["nothing", "guess", "twice"])
def test_the_serverapp_takes_exactly_one_token_from_its_pipe(stdin):
    """The ServerApp launcher refuses anything on its stdin that is not one task token (Flower's own reader)."""
    done = subprocess.run([sys.executable, "-m", "fedmvp_apps.deploy.serverapp_process", "--runtime-api-address",
                           "127.0.0.1:9", "--token-stdin", "--insecure"], input=stdin, env=ENV, capture_output=True,
                          text=True, timeout=scaled(120))
    assert done.returncode != 0 and "does not contain exactly one valid task token" in done.stderr, done.stderr
