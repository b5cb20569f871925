"""`fedmvp certs`, `fedmvp serve` and `fedmvp join` as real processes on 127.0.0.1: TLS on, node
authentication on, three sites; a node with an unregistered key and a node trusting another CA are
refused, with the reason in their logs. The server holds no image: only the world's class list.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cryptography import x509
from safetensors.torch import load_file

from fedmvp_apps.deploy.node_lines import FLOWER_LOG_ENV
from fedmvp_apps.deploy.object_log import message_objects, superlink_database, watch
from fedmvp_apps.deploy.stopping import STOP_BOUND
from fedmvp_apps.deploy.supernode import free_port
from tests.deadlines import scaled
from tests.federated.conftest import three_site_preset
from tests.federated.processes import ENV, FEDMVP, Processes


@pytest.mark.processes  # starts real processes (see pyproject.toml markers)
def test_certs_are_a_ca_a_server_certificate_and_node_keys(tmp_path):
    out = subprocess.run([*FEDMVP, "certs", "--out", str(tmp_path / "c"), "--host", "fl.example.org",
                          "--host", "10.1.2.3", "--nodes", "2", "--json"], capture_output=True, text=True, env=ENV)
    assert out.returncode == 0, out.stderr
    files = json.loads(out.stdout)
    ca = x509.load_pem_x509_certificate(Path(files["ca"]).read_bytes())
    server = x509.load_pem_x509_certificate(Path(files["server_cert"]).read_bytes())
    server.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(n.value) for n in names} == {"fl.example.org", "10.1.2.3", "localhost", "127.0.0.1"}
    assert (tmp_path / "c" / "server.key").stat().st_mode & 0o077 == 0  # private keys: owner only
    assert len(files["nodes"]) == 2 and len((tmp_path / "c" / "node-keys.txt").read_text().splitlines()) == 2
    again = subprocess.run([*FEDMVP, "certs", "--out", str(tmp_path / "c")], capture_output=True, text=True, env=ENV)
    assert again.returncode == 2 and "already holds a CA" in again.stderr


@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
@pytest.mark.timeout(300)
def test_tls_and_node_auth_three_sites_two_rounds_and_refusals(tmp_path, world6):
    (tmp_path / "site").mkdir()
    preset = three_site_preset(tmp_path / "site", world6)  # each site: the world's images on its disk
    server_world = tmp_path / "server-world"  # the server: the class list (world.json), not one image
    server_world.mkdir()
    shutil.copyfile(world6 / "world.json", server_world / "world.json")
    server_preset = tmp_path / "server.toml"
    server_preset.write_text(preset.read_text().replace(str(world6), str(server_world)))
    certs = tmp_path / "certs"
    subprocess.run([*FEDMVP, "certs", "--out", str(certs), "--nodes", "4"], check=True, capture_output=True, env=ENV)
    admitted = certs / "admitted.txt"  # node-3's key is written but not admitted
    admitted.write_text("".join((certs / f"node-{i}.pub").read_text() for i in range(3)))
    port = free_port()
    procs: list[subprocess.Popen] = []

    def start(args: list[str], log: str) -> subprocess.Popen:
        with open(tmp_path / log, "wb") as handle:
            proc = subprocess.Popen([*FEDMVP, *args], cwd=tmp_path, env=ENV, stdout=handle, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        procs.append(proc)
        return proc

    def log(name: str) -> str:
        return (tmp_path / name).read_text(errors="replace")

    join = ["join", "--superlink", f"127.0.0.1:{port}", "--config", str(preset)]
    try:
        server = start(["serve", "--config", str(server_preset), "--run-dir", "runs/tls", "--certs", str(certs),
                        "--node-keys", str(admitted), "--address", f"127.0.0.1:{port}", "--round-timeout", "120",
                        "--json"], "serve.log")
        deadline = time.time() + scaled(60)
        while "SuperNode keys admitted" not in log("serve.log"):  # Flower refuses nodes it does not know yet
            assert server.poll() is None and time.time() < deadline, log("serve.log")
            time.sleep(0.5)
        superlink_db = superlink_database(tmp_path / "runs" / "tls")
        watch(superlink_db)  # every object the SuperLink stores from now on is logged (object_log)
        intruder = start([*join, "--site", "1", "--root-certificates", str(certs / "ca.crt"),
                          "--auth-key", str(certs / "node-3")], "intruder.log")
        keyless = start([*join, "--site", "0", "--root-certificates", str(certs / "ca.crt")], "keyless.log")
        from fedmvp_apps.deploy.certs import write_certs

        other = write_certs(tmp_path / "other-ca")
        stranger = start([*join, "--site", "2", "--root-certificates", str(other.ca_cert),
                          "--auth-key", str(certs / "node-2")], "stranger.log")
        sites = [start([*join, "--site", str(site), "--root-certificates", str(certs / "ca.crt"),
                        "--auth-key", str(certs / f"node-{site}")], f"site-{site}.log") for site in range(3)]
        deadline = time.time() + scaled(180)
        while not (tmp_path / "runs" / "tls" / "round-0001" / "state.json").exists():  # the deployment is live
            assert server.poll() is None and time.time() < deadline, log("serve.log")
            time.sleep(0.5)
        _listens_only_where_it_authenticates(server, sites, port)
        assert server.wait(timeout=scaled(240)) == 0, log("serve.log") + log("site-0.log")
        assert intruder.wait(timeout=scaled(30)) == 1 and keyless.wait(timeout=scaled(30)) == 2 and stranger.wait(timeout=scaled(30)) != 0
        # The run ended: each site says so and leaves, exit 0, within the stop bound.
        assert [site.wait(timeout=STOP_BOUND) for site in sites] == [0, 0, 0], log("site-0.log")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=scaled(15))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    # A key the server does not list: one line naming the flag and what the server operator does.
    assert "refused this node's key (--auth-key)" in log("intruder.log")
    assert "must list its public key (NODE_KEY.pub) in `fedmvp serve --node-keys FILE`" in log("intruder.log")
    assert "Failed to activate SuperNode" not in log("intruder.log")
    assert "this node gave none: pass fedmvp join --auth-key NODE_KEY" in log("keyless.log"), log("keyless.log")
    assert "registered via the CLI" not in log("keyless.log")
    for site in range(3):  # the operator's own lines, one per message, not Flower's log
        shown = log(f"site-{site}.log")
        assert f"trying the SuperLink at 127.0.0.1:{port}" in shown and f"connected to 127.0.0.1:{port}" in shown
        assert re.search(r"round \d: trained on \d+ images \(loss [\d.]+, [\d.]+ s\)", shown), shown
        assert re.search(r"round 2: evaluated on \d+ images \(\d+ correct", shown), shown
        assert re.search(r"run \d+ ended on the server; leaving\n*$", shown), shown
        assert "INFO" not in shown and "Connection successful" not in shown, shown
    assert "CERTIFICATE_VERIFY_FAILED" in log("stranger.log")
    result = json.loads(log("serve.log")[log("serve.log").index("{\n"):])
    assert result["status"] == "finished:completed" and result["rounds"] == [1, 2]
    assert "submitted through `flwr run`" not in log("serve.log")  # in serve's own process (run_status)
    # Each message and its reply crossed the SuperLink as at most 3 objects: the Message, its RecordDict
    # and the one ConfigRecord (fedmvp_formats.envelope); counted from the SuperLink's own database.
    stored = message_objects(superlink_db)
    assert {"query.identify", "train", "evaluate"} <= set(stored), stored
    assert max(n for counts in stored.values() for n in counts) <= 3, stored
    assert len(stored["train"]) >= 2 * 3 * 2  # 3 sites, 2 rounds, each a message and its reply
    run = tmp_path / "runs" / "tls"
    for number in (1, 2):
        state = json.loads((run / f"round-{number:04d}" / "state.json").read_text())
        assert sorted(state["sites"]) == [0, 1, 2] and state["rejected"] == []
        assert any(k.startswith("lora.") for k in load_file(str(run / f"round-{number:04d}" / "global.safetensors")))
    # The nodes evaluated round 2 on their own data; the same round evaluated here, centrally, agrees.
    from fedmvp.federated.evaluation import evaluate_global
    from fedmvp.federated.metrics import SITE_COUNT_KEYS
    from fedmvp.federated.task import task_context
    from fedmvp.runs import RunDir

    record = RunDir(run)
    checkpoint = record.load_checkpoint(2)
    federated = {k: checkpoint.state["metrics"][k] for k in ("local", "base", "new", "hm", "domain", *SITE_COUNT_KEYS)}
    assert checkpoint.state["metrics"]["eval_sites"] == 3 and federated["hm"] is not None
    central = evaluate_global(task_context(str(preset), record.method(checkpoint)), checkpoint.tensors)
    assert federated == pytest.approx(central, abs=1e-12)


def _listens_only_where_it_authenticates(server: subprocess.Popen, sites: list[subprocess.Popen], port: int) -> None:
    """Every listening socket of a live deployment (docs/security.md, "Listeners"): `serve`'s whole tree
    (SuperLink, SuperExec, ServerApp) listens on the SuperLink's one port only (TLS and node keys: Fleet,
    Control and Runtime APIs), each site's (join, SuperNode, warm executor) on 127.0.0.1 only."""
    from fedmvp_apps.deploy.stopping import descendants
    from tests.listeners import listeners

    served = listeners({server.pid, *descendants(server.pid)})
    assert {entry.port for entry in served} == {port}, served
    for site in sites:
        found = listeners({site.pid, *descendants(site.pid)})
        assert found and all(entry.loopback for entry in found), found


@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
@pytest.mark.timeout(180)
def test_a_restart_with_fewer_node_keys_unregisters_the_rotated_out_ones(tmp_path):
    """The SuperLink keeps registrations across restarts; `serve` must remove a key dropped from the file."""
    from fedmvp_apps.deploy.certs import read_node_keys, write_certs
    from fedmvp_apps.deploy.superlink import CONNECTION, Server, ServeOptions
    from fedmvp_apps.deploy.supernode import free_port

    files = write_certs(tmp_path / "certs", nodes=3)
    (tmp_path / "two.txt").write_text("".join(pub.read_text() for _, pub in files.node_keys[:2]))
    port = free_port()

    def statuses(keys: Path) -> list[str]:
        server = Server(ServeOptions(preset="demo", run_dir=tmp_path / "runs" / "r", certs=files.out, node_keys=keys,
                                     address=f"127.0.0.1:{port}"))
        server.start()
        try:
            server.register_nodes(read_node_keys(keys))
            listed = json.loads(server.flwr("supernode", "list", CONNECTION, "--format", "json").stdout)
            return sorted(n["status"] for n in listed["nodes"])
        finally:
            server.stop()

    assert statuses(files.node_list) == ["registered"] * 3
    assert statuses(tmp_path / "two.txt") == ["registered", "registered", "unregistered"]
    assert statuses(tmp_path / "two.txt") == ["registered", "registered", "unregistered"]  # nothing twice


@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
@pytest.mark.timeout(120)
def test_a_join_before_the_server_is_up_names_the_address_and_claims_no_connection(tmp_path):
    """Nothing listens at the address: one line naming it and that the node keeps trying; Flower's
    "Connection successful" (the node's own local API) is not shown, nor any INFO record."""
    port = free_port()
    procs = Processes(tmp_path)
    flower_log = tmp_path / "flower.log"  # Flower's whole log: where its "successful" goes instead
    try:
        procs.start("join", ["join", "--superlink", f"127.0.0.1:{port}", "--config", "demo", "--site", "0",
                             "--insecure"], env={**ENV, FLOWER_LOG_ENV: str(flower_log)})
        procs.wait_for("the address line", lambda: "trying the SuperLink" in procs.log("join"), 60, watch="join")
        procs.wait_for("the executor on its SuperNode's local API", lambda: flower_log.is_file() and
                       "executor: INFO :      Connection successful" in flower_log.read_text(), 60, watch="join")
        assert procs.procs["join"].poll() is None  # it keeps trying
    finally:
        procs.stop()
    shown = procs.log("join")
    assert f"trying the SuperLink at 127.0.0.1:{port}; this node keeps trying until it answers" in shown, shown
    assert "Connection successful" not in shown and "connected to" not in shown and "INFO" not in shown, shown


@pytest.mark.parametrize("args,message", [
    (["serve", "--config", "demo", "--run-dir", "r", "--certs", "nowhere"], "nowhere: missing ca.crt"),
    (["serve", "--config", "demo", "--run-dir", "r", "--insecure", "--node-keys", "k.txt"], "k.txt: key 1 is not"),
    (["serve", "--config", "demo", "--run-dir", "r", "--insecure", "--node-keys", "missing.txt"], "cannot read"),
    (["serve", "--config", "demo", "--run-dir", "r", "--insecure", "--node-keys", "good.txt"], "needs TLS"),
    (["serve", "--config", "demo", "--run-dir", "r", "--insecure", "--address", "9092"], "expected HOST:PORT"),
    (["serve", "--config", "nope", "--run-dir", "r", "--insecure"], "nope: no such preset"),
    (["serve", "--config", "demo", "--run-dir", "r", "--certs", "c"], "with TLS, give --node-keys FILE"),
    (["serve", "--config", "demo", "--run-dir", "r", "--insecure", "--allow-any-node"], "--allow-any-node goes with"),
    (["serve", "--config", "demo", "--run-dir", "r", "--certs", "c", "--node-keys", "good.txt", "--allow-any-node"],
     "--allow-any-node goes with"),
    (["join", "--superlink", "h:1", "--config", "demo", "--site", "0"], "give --root-certificates"),
    (["join", "--superlink", "h:1", "--config", "demo", "--site", "0", "--root-certificates", "no.crt"],
     "no.crt: no such file"),
])
def test_bad_serve_and_join_arguments_are_one_line_and_start_nothing(tmp_path, args, message):
    from click.testing import CliRunner

    from fedmvp_apps.cli import main
    from fedmvp_apps.deploy.certs import write_certs

    with CliRunner().isolated_filesystem(temp_dir=tmp_path):
        Path("k.txt").write_text("ecdsa-sha2-nistp384 AAAA\n")  # not a key
        Path("good.txt").write_text(write_certs("c", nodes=1).node_list.read_text())
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and message in result.output, result.output
        assert not Path("r").exists() and not list(Path(".").glob(".r.flwr"))
