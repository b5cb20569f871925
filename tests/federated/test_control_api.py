"""Only the operator controls the server (docs/security.md), tried as an outsider would, with real
processes on 127.0.0.1: `fedmvp serve` over TLS with node authentication, and an outsider whose
Flower home holds only the federation's public ``ca.crt`` (every site gets it) or a site's node key.

One deployment serves every assertion: the outsider can neither list, stop nor submit runs, nor
register a node key of its own, nor log in, nor claim the run's ServerApp task with a SuperExec of
its own; its app's ServerApp never runs. `serve` itself lists and, on Ctrl-C, stops its run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.deadlines import scaled
from tests.federated.conftest import three_site_preset
from tests.federated.processes import ENV, FEDMVP, Processes

OUTSIDER_APP = '''[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "outsider"
version = "1.0.0"
dependencies = []

[tool.flwr.app]
publisher = "outsider"

[tool.flwr.app.components]
serverapp = "outsider_app:app"
clientapp = "outsider_app:client"
'''
OUTSIDER_CODE = '''from pathlib import Path
from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

app = ServerApp()
client = ClientApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    Path({marker!r}).write_text("the outsider's code ran on the server")
'''


def _outsider_home(root: Path, port: int, ca: Path) -> dict[str, str]:
    home = root / "outsider-home"
    home.mkdir()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "target"\n\n[superlink.target]\n'
                                      f'address = "127.0.0.1:{port}"\nroot-certificates = "{ca}"\n')
    return {**ENV, "FLWR_HOME": str(home)}


def _flwr(env: dict[str, str], *args: str) -> tuple[bool, str]:
    """(success, message) of one `flwr` command with JSON output (flwr exits 0 on refusals too)."""
    done = subprocess.run(["flwr", *args, "target", "--format", "json"], env=env, capture_output=True, text=True,
                          timeout=scaled(120))
    try:
        reply = json.loads(done.stdout)
    except ValueError:
        return done.returncode == 0, done.stdout + done.stderr
    return bool(reply.get("success")), str(reply.get("error-message", reply))


def _control(port: int, ca: Path, path: str, token: str | None) -> int:
    """HTTP status of one raw Control API call (what a hand-written client gets)."""
    import ssl

    import httpx

    headers = {"content-type": "application/protobuf"}
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    with httpx.Client(verify=ssl.create_default_context(cafile=str(ca)), timeout=scaled(30)) as client:
        return client.post(f"https://127.0.0.1:{port}/v1/control/{path}", headers=headers, content=b"").status_code


@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore::DeprecationWarning:pathspec")  # Flower's FAB build, in this process
def test_an_outsider_with_the_ca_certificate_or_a_node_key_controls_nothing(tmp_path, world6):
    from fedmvp_apps.deploy.supernode import free_port

    preset = three_site_preset(tmp_path, world6, rounds=50)  # no site joins: the run waits for nodes
    certs = tmp_path / "certs"
    subprocess.run([*FEDMVP, "certs", "--out", str(certs), "--nodes", "2"], check=True, capture_output=True, env=ENV)
    port = free_port()
    outsider = _outsider_home(tmp_path, port, certs / "ca.crt")
    marker = tmp_path / "outsider-ran.txt"
    app = tmp_path / "outsider-app"
    app.mkdir()
    (app / "pyproject.toml").write_text(OUTSIDER_APP)
    (app / "outsider_app.py").write_text(OUTSIDER_CODE.format(marker=str(marker)))
    procs = Processes(tmp_path)
    try:
        procs.start("serve", ["serve", "--config", str(preset), "--run-dir", "runs/guarded", "--certs", str(certs),
                              "--node-keys", str(certs / "node-keys.txt"), "--address", f"127.0.0.1:{port}"])
        procs.wait_for("the run", lambda: " submitted: " in procs.log("serve"), 90)
        run_id = procs.log("serve").split("serve: run ", 1)[1].split()[0]

        listed, why = _flwr(outsider, "ls")
        assert not listed and "Authentication failed" in why, why
        stopped, why = _flwr(outsider, "stop", run_id)
        assert not stopped and "Authentication failed" in why, why
        registered, why = _flwr(outsider, "supernode", "register", str(certs / "node-1.pub"))
        assert not registered and "Authentication failed" in why, why
        login = subprocess.run(["flwr", "login", "target"], env=outsider, capture_output=True, text=True, timeout=scaled(60))
        assert login.returncode != 0 and "not enabled" in login.stdout + login.stderr
        submitted, why = _flwr(outsider, "run", str(app))
        assert not submitted and "Authentication failed" in why, why

        node_key = (certs / "node-0").read_text().split("\n")[1]  # a line of the site's private key
        for token in (None, "guess", node_key, (certs / "node-0.pub").read_text().split()[1]):
            assert _control(port, certs / "ca.crt", "list-runs", token) == 401

        # A SuperExec of the outsider's own, to claim the run's ServerApp task: refused by the Runtime API.
        thief = subprocess.run(["timeout", "8", "flower-superexec", "--runtime-api-address", f"127.0.0.1:{port}",
                                "--root-certificates", str(certs / "ca.crt")], env=outsider, capture_output=True,
                               text=True, timeout=scaled(60))
        assert thief.returncode == 0  # it gave up by itself, before `timeout` ended it
        superlink_log = (tmp_path / "runs" / "guarded.superlink.log").read_text()
        assert "SuperExec authentication failed for /flwr.proto.Runtime/AcquireTask" in superlink_log

        # What `serve` watches its run with, in its own process (no `flwr ls` interpreter a second):
        # the operator token reads the run's status; any other is refused.
        from fedmvp_apps.deploy.run_status import RunStatusClient

        operator = (tmp_path / "runs" / ".guarded.flwr" / "operator.token").read_text().strip()
        for token, admitted in ((operator, True), ("g" * 43, False), (node_key, False)):
            client = RunStatusClient(f"127.0.0.1:{port}", token, certs / "ca.crt")
            try:
                if admitted:
                    assert client.status(int(run_id)).split(":")[0] in ("starting", "running")
                else:
                    with pytest.raises(Exception):
                        client.status(int(run_id))
                    with pytest.raises(Exception):  # what serve submits its run with: the operator's alone
                        client.start_run(app, "x=1")
            finally:
                client.close()

        time.sleep(3)
        assert not marker.exists()  # the outsider's ServerApp never ran
        assert procs.procs["serve"].poll() is None  # the federation's run goes on
        assert "finished" not in procs.log("serve")

        os.kill(procs.procs["serve"].pid, signal.SIGINT)  # the operator's Ctrl-C: serve stops its own run
        assert procs.procs["serve"].wait(timeout=scaled(90)) == 1
    finally:
        procs.stop()
    assert f"interrupted: run {run_id} stopped" in procs.log("serve"), procs.log("serve")[-2000:]
    assert not marker.exists()
    token = tmp_path / "runs" / ".guarded.flwr" / "operator.token"
    assert token.stat().st_mode & 0o077 == 0  # the operator token: owner only


TOKEN = "t" * 43
ACCESS, REFRESH = "flwr-oidc-access-token", "flwr-oidc-refresh-token"  # Flower's metadata keys


@pytest.mark.parametrize("metadata,valid", [
    ([], False),
    ([(ACCESS, "guess")], False),
    ([(ACCESS, TOKEN[:-1])], False),
    ([(ACCESS, TOKEN + "x")], False),
    ([(ACCESS, TOKEN), (ACCESS, TOKEN)], False),  # one token, not a list to pick from
    ([(REFRESH, TOKEN)], False),
    ([(ACCESS, TOKEN)], True),
    ([(ACCESS, TOKEN.encode())], True),
], ids=["none", "guess", "prefix", "longer", "twice", "refresh-key", "token", "token-bytes"])
def test_the_operator_plugin_admits_exactly_its_token(metadata, valid):
    from flwr.common.constant import ACCESS_TOKEN_KEY, NOOP_FLWR_AID, REFRESH_TOKEN_KEY

    from fedmvp_apps.deploy.control_auth import OperatorTokenAuthn

    assert (ACCESS_TOKEN_KEY, REFRESH_TOKEN_KEY) == (ACCESS, REFRESH)
    plugin = OperatorTokenAuthn(TOKEN)
    ok, account = plugin.validate_tokens_in_metadata(metadata)
    assert ok is valid and (account.flwr_aid == NOOP_FLWR_AID if valid else account is None)
    assert (plugin.refresh_tokens(metadata)[0] is not None) is valid


@pytest.mark.parametrize("setup,fragment", [
    (None, "FEDMVP_OPERATOR_TOKEN_FILE is not set"),
    (lambda p: None, "cannot read the operator token"),
    (lambda p: (p.write_text("short"), p.chmod(0o600)), "shorter than 32"),
    (lambda p: (p.write_text(TOKEN), p.chmod(0o644)), "readable by others (mode 644)"),
], ids=["unset", "missing", "short", "world-readable"])
@pytest.mark.processes  # a refusal (exit 2): no federation starts (tests/process_markers.py)
def test_the_superlink_launcher_refuses_to_start_open(tmp_path, setup, fragment):
    """Fail closed: no usable token, no SuperLink (and so never an open Control API)."""
    env = {k: v for k, v in ENV.items() if k != "FEDMVP_OPERATOR_TOKEN_FILE"}
    if setup is not None:
        token = tmp_path / "operator.token"
        setup(token)
        env["FEDMVP_OPERATOR_TOKEN_FILE"] = str(token)
    import sys

    done = subprocess.run([sys.executable, "-m", "fedmvp_apps.deploy.superlink_process", "--insecure"], env=env,
                          capture_output=True, text=True, timeout=scaled(120))
    assert done.returncode == 2 and fragment in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_serve_writes_the_token_owner_only_and_the_cli_credentials_beside_it(tmp_path):
    from fedmvp_apps.deploy.control_auth import read_operator_token, store_cli_credentials, write_operator_token

    token = write_operator_token(tmp_path / "home" / "operator.token")
    assert read_operator_token(tmp_path / "home" / "operator.token") == token and len(token) >= 32
    assert write_operator_token(tmp_path / "other.token") != token  # random at each start
    store_cli_credentials(tmp_path / "home", "127.0.0.1:9092", token)
    assert (tmp_path / "home" / "credentials.yaml").stat().st_mode & 0o077 == 0
