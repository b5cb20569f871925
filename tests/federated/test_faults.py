"""Faults of a real federation on 127.0.0.1 (TLS on): a site killed mid-round, the server killed.

- A SuperNode killed (SIGKILL) while a round waits for it: the round closes with the other sites'
  replies (min-nodes 2 of 3) as soon as the SuperLink takes the node for gone (two missed 10 s
  heartbeats), long before its round_timeout, and the run goes on; started again, the site joins
  a later round.
- `fedmvp serve` killed (SIGKILL, with its SuperLink) and started again with the same command: the
  run resumes from its last complete round; no round directory is left half-written.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.deadlines import scaled
from tests.federated.conftest import three_site_preset
from tests.federated.processes import ENV, FEDMVP, Processes, json_result

pytestmark = pytest.mark.deployment  # starts a federation (see pyproject.toml markers)

ROUNDS = 5


def states(run) -> dict[int, dict]:
    out = {}
    for path in sorted(run.glob("round-*/state.json")):
        out[int(path.parent.name.split("-")[1])] = json.loads(path.read_text())
    return out


@pytest.mark.slow  # five rounds; a killed site's round waits for its missed heartbeats; serve killed and restarted
@pytest.mark.timeout(600)
def test_a_site_and_the_server_killed_mid_run(tmp_path, world6):
    from fedmvp_apps.deploy.supernode import free_port

    preset = three_site_preset(tmp_path, world6, rounds=ROUNDS)
    certs = tmp_path / "certs"
    subprocess.run([*FEDMVP, "certs", "--out", str(certs)], check=True, capture_output=True, env=ENV)
    port = free_port()
    serve = ["serve", "--config", str(preset), "--run-dir", "runs/faults", "--certs", str(certs),
             "--allow-any-node", "--address", f"127.0.0.1:{port}", "--min-nodes", "2", "--round-timeout", "300", "--json"]
    join = ["join", "--superlink", f"127.0.0.1:{port}", "--config", str(preset),
            "--root-certificates", str(certs / "ca.crt"), "--site"]
    run = tmp_path / "runs" / "faults"
    procs = Processes(tmp_path)
    try:
        procs.start("serve", serve)
        procs.wait_for("SuperLink", lambda: "SuperLink listening" in procs.log("serve"), 60)
        for site in range(3):
            procs.start(f"site-{site}", [*join, str(site)])
        procs.wait_for("round 1", lambda: 1 in states(run), 240)
        procs.kill("site-2")  # round 2 is under way: its message to site 2 is never answered
        # Restarted at once (a new node): connected before round 2 closes, so it is back in round 3 and
        # rounds are left to kill the server in, however fast the rounds are.
        procs.start("site-2", [*join, "2"])
        procs.wait_for("round 2", lambda: 2 in states(run), 240)
        assert sorted(states(run)[2]["sites"]) == [0, 1]  # closed with the others' replies,
        # because the SuperLink answered for the dead node (not at the timeout: nothing timed out)
        assert states(run)[2]["timed_out"] == [] and any(
            "Node Unavailable" in r["reason"] for r in states(run)[2]["rejected"]), states(run)[2]
        procs.wait_for("site 2 back", lambda: any(sorted(s["sites"]) == [0, 1, 2]
                                                  for n, s in states(run).items() if n > 2), 240)
        assert len(states(run)) < ROUNDS, "the run ended before its server could be killed mid-run"
        procs.kill("serve")  # the server machine dies: serve, its SuperLink and the ServerApp
        procs.start("serve", serve)
        assert procs.procs["serve"].wait(timeout=scaled(240)) == 0, procs.log("serve")[-3000:]
    finally:
        procs.stop()
    result = json_result(procs.log("serve"))
    assert result["status"] == "finished:completed" and result["rounds"] == list(range(1, ROUNDS + 1))
    # Admitting any node is said at each start and at every round the server saw close.
    assert procs.log("serve").count("serve: warning: --allow-any-node") == 2
    assert "serve: round 1: warning: --allow-any-node" in procs.log("serve")
    assert sorted(p.name for p in run.glob("round-*")) == [f"round-{n:04d}" for n in range(1, ROUNDS + 1)]
    assert all(s["complete"] for s in states(run).values())
