"""A region served as a buffered federation feeds the central run (docs/howto/regions.md), real processes
on 127.0.0.1, TLS on: `fedmvp region-start --rounds 2` from central round 2, `fedmvp serve --mode buffered`
resumed on the region with two `edge-client join` devices on bundles exported from the region, then
`fedmvp region-update` and the central `fedmvp ingest`.

- The region serves exactly its own budget: versions 3 and 4, then the serve exits 0.
- The devices train for the region: their bundles and update files name the region's run id, never the
  central run's.
- The region's update file counts the examples of the versions' replies (state.json ``replies[].examples``)
  and the central round 3 is theta_2 + server_lr * (L_4 - R_2): one file, staleness 0, weight 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from tests.federated.processes import ENV, FEDMVP, Processes
from tests.federated.test_edge_join import local_folder, prepare_run, states, update_files
from tests.federated.test_ingest import lora_of

pytestmark = pytest.mark.processes  # starts real processes (see pyproject.toml markers)

BUFFERED = """
[server]
concurrency = 2
buffer_size = 2
max_staleness = 20
round_timeout = 45
"""


def cli(*args: str) -> dict:
    done = subprocess.run([*FEDMVP, *args, "--json"], env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{args}\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout)


@pytest.mark.timeout(600)
def test_a_served_buffered_region_enters_the_central_run_as_one_update(tmp_path, small_world):
    from edge_client.bundle import Bundle
    from export.bundle_writer import export_bundle
    from fedmvp_apps.deploy.supernode import free_port
    from fedmvp.runs import RunDir

    preset, central = prepare_run(tmp_path, small_world, 2, BUFFERED)  # rounds 1-2 done: the central run is complete
    region = tmp_path / "region"
    link = cli("region-start", "--central", str(central), "--round", "2", "--rounds", "2", "--out", str(region))
    assert (link["central_round"], link["rounds"]) == (2, 2)
    region_id, central_id = RunDir(region).read_config()["run_id"], RunDir(central).read_config()["run_id"]
    assert RunDir(region).read_config()["rounds"] == 4 and region_id != central_id
    bundles = {name: tmp_path / f"device-{name}" / "bundle" for name in "ab"}
    for bundle in bundles.values():
        export_bundle(region, 2, bundle)
        assert Bundle.open(bundle).run_id == region_id
    classes = Bundle.open(bundles["a"]).class_names
    data = {"a": local_folder(small_world, classes[:3], 4, tmp_path / "device-a" / "local"),
            "b": local_folder(small_world, classes[2:4], 4, tmp_path / "device-b" / "local")}
    certs = tmp_path / "certs"
    subprocess.run([*FEDMVP, "certs", "--out", str(certs)], check=True, capture_output=True, env=ENV)
    port = free_port()
    procs = Processes(tmp_path)
    edge_client = str(Path(sys.executable).parent / "edge-client")
    try:
        procs.start("serve", ["serve", "--config", str(preset), "--run-dir", str(region), "--certs", str(certs),
                              "--allow-any-node", "--address", f"127.0.0.1:{port}", "--min-nodes", "1", "--mode",
                              "buffered", "--json"])
        procs.wait_for("SuperLink", lambda: "SuperLink listening" in procs.log("serve"), 60)
        for name in "ab":
            procs.start(f"edge-{name}", ["--superlink", f"127.0.0.1:{port}", "--bundle", str(bundles[name]),
                                         "--data", str(data[name]), "--root-certificates", str(certs / "ca.crt"),
                                         "--out", str(tmp_path / f"device-{name}" / "updates"), "--epochs", "1",
                                         "--lr", "0.01", "--optimizer", "adamw", "--eval-fraction", "0.25",
                                         "--threads", "1"],
                        command=[edge_client, "join"])
        assert procs.procs["serve"].wait(timeout=400) == 0, procs.log("serve")[-3000:]
    finally:
        procs.stop()
    versions = states(region)
    assert sorted(versions) == [2, 3, 4]  # the region's budget, not the central run's rounds (2: nothing left)
    replies = [r for v in (3, 4) for r in versions[v]["replies"]]
    assert len(replies) == 4 and all(r["examples"] > 0 for r in replies)
    for name in "ab":  # the devices trained for the region, under its run id
        for path in update_files(tmp_path / f"device-{name}" / "updates"):
            with safe_open(str(path), "np") as handle:
                assert handle.metadata()["run_id"] == region_id

    made = cli("region-update", "--run", str(region), "--out", str(tmp_path / "region.st"))
    assert (made["rounds"], made["central_round"]) == ([3, 4], 2)
    assert made["examples"] == sum(r["examples"] for r in replies)
    report = cli("ingest", "--run", str(central), str(tmp_path / "region.st"))
    assert report["round"] == 3 and report["rejected"] == [], report
    assert [(r["num_examples"], r["staleness"]) for r in report["accepted"]] == [(made["examples"], 0)]
    theta, after, last, base = lora_of(central, 2), lora_of(central, 3), lora_of(region, 4), lora_of(region, 2)
    for name in theta:  # server_lr 1 (the default), one file of weight n s(0) / n = 1
        step = last[name].astype(np.float64) - base[name]
        np.testing.assert_allclose(after[name], theta[name] + step, rtol=0, atol=1e-5)
        assert np.abs(step).max() > 1e-4  # the region's devices moved it
