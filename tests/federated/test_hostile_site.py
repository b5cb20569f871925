"""A site whose node lies about its packed tensors, over the real network (docs/security.md).

Real processes on 127.0.0.1: `fedmvp serve` with TLS and node keys, two honest sites and one admitted
site (site 1) whose installed ClientApp has been replaced by a hostile one (its own ``node_app``
package first on the path: what a compromised site machine runs). Its train replies are fedmvp's own,
then spoiled in the packed wire format (``fedmvp_formats/packed.py``), one lie a round:

1. the layout declares a first tensor of 2**32 x 2**32 values (2**64: wraps to 0 in int64);
2. the packed array is float64, not float32;
3. the layout names a tensor the round did not ask for.

What crosses the SuperLink is judged by the same reader as in ``test_reply_attacks.py`` (records
built in process); here the reply went through Flower's SuperNode, SuperLink, object store and
ServerApp first. Each lie is refused for what it is, recorded in the round's ``state.json``, and the
honest sites' replies alone are averaged, every round.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.deadlines import scaled
from tests.federated.conftest import three_site_preset
from tests.federated.processes import ENV, FEDMVP, Processes

pytestmark = pytest.mark.deployment  # starts a federation (see pyproject.toml markers)

HOSTILE_APP = '''"""A compromised site's ClientApp: fedmvp's own, its train replies spoiled (test_hostile_site.py)."""
import io

import numpy as np
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedmvp.federated import client_app as real
from fedmvp.federated.wire import content_records, records_content

app = ClientApp()
app.query("identify")(real.identify)
app.evaluate()(real.evaluate)


@app.train()
def train(msg: Message, context: Context) -> Message:
    reply = real.train(msg, context)
    records = content_records(reply.content)
    layout = records["layout"]
    lie = int(content_records(msg.content)["config"]["round"])
    if lie == 1:
        first = layout["ranks"][0]
        layout["ranks"][0] = 2
        layout["dims"] = [2 ** 32, 2 ** 32] + layout["dims"][first:]
    elif lie == 2:
        flat = np.load(io.BytesIO(records["arrays"]["tensors"]), allow_pickle=False)
        stream = io.BytesIO()
        np.save(stream, flat.astype(np.float64), allow_pickle=False)
        records["arrays"]["tensors"] = stream.getvalue()
    else:
        layout["names"].append("lora.planted")
        layout["ranks"].append(1)
        layout["dims"].append(1)
    return Message(content=records_content(records), reply_to=msg)
'''
LIES = {1: "values declared, more than 2147483648 float32s", 2: "the bytes are not a .npy of", 3: "unexpected"}


@pytest.mark.timeout(420)
def test_a_site_lying_about_its_packed_tensors_is_refused_for_each_lie(tmp_path, world6):
    import subprocess

    from fedmvp_apps.deploy.supernode import free_port

    preset = three_site_preset(tmp_path, world6, rounds=3)
    preset.write_text(preset.read_text() + "\n[server]\nmin_nodes = 2\n")  # the two honest sites close a round
    hostile = tmp_path / "compromised" / "node_app"
    hostile.mkdir(parents=True)
    (hostile / "__init__.py").write_text("")
    (hostile / "client_app.py").write_text(HOSTILE_APP)
    hostile_env = {**ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(hostile.parent), ENV.get("PYTHONPATH")]))}
    certs = tmp_path / "certs"
    subprocess.run([*FEDMVP, "certs", "--out", str(certs), "--nodes", "3"], check=True, capture_output=True, env=ENV)
    port = free_port()
    join = ["join", "--superlink", f"127.0.0.1:{port}", "--config", str(preset), "--threads", "1",
            "--root-certificates", str(certs / "ca.crt")]
    procs = Processes(tmp_path)
    try:
        procs.start("serve", ["serve", "--config", str(preset), "--run-dir", "runs/hostile", "--certs", str(certs),
                              "--node-keys", str(certs / "node-keys.txt"), "--address", f"127.0.0.1:{port}",
                              "--round-timeout", "120", "--json"])
        procs.wait_for("the node keys", lambda: "SuperNode keys admitted" in procs.log("serve"), 90)
        for site in (1, 0, 2):  # the compromised site first: it is connected when round 1 is sent
            procs.start(f"site-{site}", [*join, "--site", str(site), "--auth-key", str(certs / f"node-{site}")],
                        env=hostile_env if site == 1 else ENV)
        assert procs.procs["serve"].wait(timeout=scaled(360)) == 0, procs.log("serve")[-3000:] + procs.log("site-1")[-3000:]
    finally:
        procs.stop()
    result = json.loads(procs.log("serve")[procs.log("serve").index("{\n"):])
    assert result["status"] == "finished:completed" and result["rounds"] == [1, 2, 3]
    run = tmp_path / "runs" / "hostile"
    for number, lie in LIES.items():  # `serve` said each left-out reply as the ServerApp logged it
        assert re.search(rf"^serve: round {number}: left out the reply of site 1 \(node \d+\): .*{re.escape(lie)}",
                         procs.log("serve"), re.M), procs.log("serve")[-3000:]
    assert " LEFT-OUT flwr: round 1: left out the reply of site 1 " in (run / "flower.log").read_text()
    for number, lie in LIES.items():
        state = json.loads((run / f"round-{number:04d}" / "state.json").read_text())
        refused = [r for r in state["rejected"] if r["site"] == 1]
        assert refused and all(lie in r["reason"] for r in refused), (number, state["rejected"])
        assert 1 not in state["sites"] and set(state["sites"]) <= {0, 2} and len(state["sites"]) == 2
        tensors = load_file(str(run / f"round-{number:04d}" / "global.safetensors"))
        assert all(np.isfinite(t).all() for t in tensors.values())
