"""A backdoor attacker among edge devices in a real federation on 127.0.0.1 (TLS on, node keys on):
`fedmvp serve` with ``[server] update_rule = "multi_krum"`` (assumed_malicious = 1) and five `edge-client
join` devices, each with its own node key. Four are honest; the fifth is malicious by its data alone:
its local folder holds its images plus each of them with a trigger patch filed under the target class
(``benchmarks.poison_attacks.backdoor_folder``), and it trains harder (lr 0.1, 3 epochs), as an attacker
that wants its backdoor in the global LoRA does. Its reply is an ordinary `edge-client join` reply.

The round's state.json records what the rule screened ("screened": node, role, action, reason, weight):
the malicious device's node is dropped or down-weighted there. Five devices, not four: Multi-Krum with
one assumed attacker scores each update on its n - f - 2 nearest others, which needs n >= 5.
The rule arrives with the robust update rules; until it is registered the test is skipped.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.deadlines import scaled
from tests.federated.processes import ENV, FEDMVP, Processes, json_result
from tests.federated.test_edge_join import local_folder, prepare_run, states

pytestmark = pytest.mark.deployment  # starts a federation (see pyproject.toml markers)

RULE = "multi_krum"
ROBUST = f"""
[server]
update_rule = "{RULE}"
assumed_malicious = 1
round_timeout = 120
"""
HONEST = "abcd"
ROUND = 3  # rounds 1-2 are prepared (tests/federated/test_edge_join.py): one served round


@pytest.mark.timeout(600)
def test_multi_krum_screens_a_backdoor_device_out_of_a_served_round(tmp_path, small_world):
    from fedmvp.federated.update_rules import UPDATE_RULES

    if RULE not in UPDATE_RULES:
        pytest.skip(f"update rule {RULE!r} is not registered in this tree (fedmvp/federated/update_rules.py; "
                    f"it comes with the robust update rules)")
    from benchmarks.poison_attacks import backdoor_folder
    from edge_client.bundle import Bundle
    from export.bundle_writer import export_bundle
    from fedmvp_apps.deploy.supernode import free_port

    preset, run = prepare_run(tmp_path, small_world, ROUND, ROBUST)
    names = [*HONEST, "m"]
    bundles = {name: tmp_path / f"device-{name}" / "bundle" for name in names}
    for bundle in bundles.values():
        export_bundle(run, 2, bundle)
    classes = Bundle.open(bundles["a"]).class_names
    data = {name: local_folder(small_world, classes[k:k + 3], 4, tmp_path / f"device-{name}" / "local")
            for k, name in enumerate(HONEST)}
    target = classes[-1]
    own = local_folder(small_world, classes[:3], 4, tmp_path / "device-m" / "own")
    data["m"] = backdoor_folder(own, tmp_path / "device-m" / "local", target)
    certs = tmp_path / "certs"
    subprocess.run([*FEDMVP, "certs", "--out", str(certs), "--nodes", str(len(names))], check=True,
                   capture_output=True, env=ENV)
    admitted = certs / "admitted.txt"
    admitted.write_text("".join((certs / f"node-{i}.pub").read_text() for i in range(len(names))))
    port = free_port()
    procs = Processes(tmp_path)
    edge_client = str(Path(sys.executable).parent / "edge-client")
    try:
        procs.start("serve", ["serve", "--config", str(preset), "--run-dir", str(run), "--certs", str(certs),
                              "--node-keys", str(admitted), "--address", f"127.0.0.1:{port}", "--min-nodes",
                              str(len(names)), "--json"])
        procs.wait_for("node keys", lambda: "SuperNode keys admitted" in procs.log("serve"), 180)
        for i, name in enumerate(names):
            recipe = ["--epochs", "3", "--lr", "0.1"] if name == "m" else ["--epochs", "1", "--lr", "0.01"]
            procs.start(f"edge-{name}", ["--superlink", f"127.0.0.1:{port}", "--bundle", str(bundles[name]),
                                         "--data", str(data[name]), "--root-certificates", str(certs / "ca.crt"),
                                         "--auth-key", str(certs / f"node-{i}"), "--out",
                                         str(tmp_path / f"device-{name}" / "updates"), "--optimizer", "adamw",
                                         "--eval-fraction", "0.25", "--threads", "1", *recipe],
                        command=[edge_client, "join"])
        assert procs.procs["serve"].wait(timeout=scaled(420)) == 0, procs.log("serve")[-3000:]
    finally:
        procs.stop()
    assert json_result(procs.log("serve"))["status"] == "finished:completed"
    state = states(run)[ROUND]
    replies = [r for r in state["replies"] if r["role"] == "edge"]
    assert len(replies) == len(names), state["replies"]
    # The attacker trained on its images and their triggered copies: the most examples of any device.
    bad = max(replies, key=lambda r: r["examples"])
    assert sorted(r["examples"] for r in replies).count(bad["examples"]) == 1, replies
    share = bad["examples"] / sum(r["examples"] for r in replies)  # its weight under FedAvg
    assert bad.get("weight") is None or bad["weight"] < share, replies
    screened = state.get("screened")
    assert screened, f"round {ROUND} records nothing screened: {sorted(state)}"
    hits = [e for e in screened if e["node"] == bad["node"]]
    assert hits and hits[0]["action"] in ("dropped", "down-weighted") and hits[0]["reason"], screened
    assert sum(e["action"] == "dropped" for e in screened) <= 1  # assumed_malicious = 1: one dropped at most
