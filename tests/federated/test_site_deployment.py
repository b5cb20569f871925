"""Sites that hold only their own data, deployed (docs/tutorials/across-machines.md): `fedmvp serve` on a
[federation] preset with no image on the server, TLS with node authentication, three `fedmvp join --data`
sites, each folder holding only its own classes (one also a new class), no shared root. One deployment
serves every assertion (its cost):

- the recorded examples exclude new-class images, and each site's classes are recorded as counts;
- a site killed (SIGKILL) after round 1 and started again with the same command rejoins;
- the federated evaluation equals the simulation of the same folders (`fedmvp train` on the preset
  with `data = ...`): every round's counts-based accuracies and site counts equal, the losses and the
  global weights equal to float32 noise (bitwise equal where both train on one thread, as here). The
  zero-shot row is not compared: the deployed one is asked of whoever is connected when the run starts;
- `fedmvp-export` of the served run from a directory without any data;
- each listed site bound to its node key (`[[sites]] node_key`): a fourth node, its key admitted but
  not site-b's, joins as site-b and is sent no work, one line naming the site and why (the rounds are
  the three sites' alone, as the simulation's).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from fedmvp_apps.deploy.supernode import free_port
from tests.deadlines import scaled
from tests.federated.processes import ENV, FEDMVP, Processes, json_result
from tests.site_trees import site_preset, world_classes

pytestmark = pytest.mark.deployment  # starts a federation (see pyproject.toml markers)

EXPORT = [*FEDMVP[:2], "fedmvp_apps.export_cli"]
ROUNDS = 3
ACCURACIES = ("local", "base", "new", "hm")  # from counts: equal, or the two evaluations differ
SITE_COUNTS = ("local_sites", "base_sites", "new_sites", "domain_sites", "hm_sites")
LOSSES = ("train_loss", "train_ce", "train_consistency")


def _site_classes(world: Path) -> tuple[dict[str, list[str]], list[str]]:
    """site-a: 2 base classes and the new class; site-b: 2 others; site-c: 3 others."""
    seen, held = world_classes(world)
    return {"site-a": seen[:2] + held[:1], "site-b": seen[2:4], "site-c": seen[4:7]}, held[:1]


def _presets(folder: Path, world: Path) -> tuple[Path, Path, dict[str, Path]]:
    """The federation's preset as a deployment writes it ([[sites]] by name, no data), each site's folder
    moved to a disk of its own, and the simulation's preset of the same folders (`data = DISK`)."""
    sites, new = _site_classes(world)
    (folder / "draft").mkdir()
    built = site_preset(folder / "draft", world, sites, new, rounds=ROUNDS)
    disks = {}
    for name in sites:
        disks[name] = folder / f"{name}-disk" / "images"
        shutil.move(str(built.parent / "sites" / name), disks[name])
    presets = {}
    for kind in ("server", "simulation"):
        presets[kind] = folder / kind / "clinics.toml"
        presets[kind].parent.mkdir()
        shutil.copy(built.parent / "attributes.json", presets[kind].parent / "attributes.json")
    text = built.read_text()
    presets["server"].write_text(re.sub(r'data = "sites/([^"]+)"', lambda m: f'node_key = "../certs/node-{list(sites).index(m[1])}.pub"',
                                        text))  # each site bound to its key (the deployment's certs/node-I.pub)
    presets["simulation"].write_text(re.sub(r'data = "sites/([^"]+)"', lambda m: f"data = {json.dumps(str(disks[m[1]]))}",
                                            text))
    shutil.rmtree(built.parent)
    return presets["server"], presets["simulation"], disks


def _states(run: Path) -> dict[int, dict]:
    return {int(p.parent.name.split("-")[1]): json.loads(p.read_text()) for p in sorted(run.glob("round-*/state.json"))}


def _rows(run: Path) -> dict[int, dict]:
    return {r["round"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _rejoin(procs: Processes, name: str, args: list[str], back, timeout: float) -> int:
    """Start ``name`` again with the same command until ``back()``; how many starts it took. Flower keeps a
    SIGKILLed node online for two heartbeats (2 x 10 s, fedmvp_apps/deploy/supernode_process.py) and refuses its key until then: the restarted
    SuperNode exits, and its operator (here: this loop, every 5 s) starts it again."""
    deadline, starts = time.time() + scaled(timeout), 0
    while not back():
        proc = procs.procs[name]
        if proc.poll() is not None:
            if starts:
                time.sleep(5)
            procs.start(name, args)
            starts += 1
        assert procs.procs["serve"].poll() is None, procs.log("serve")[-3000:]
        assert time.time() < deadline, f"{name} not back within {timeout} s\n{procs.log(name)[-3000:]}"
        time.sleep(0.5)
    return starts


@pytest.mark.slow  # three rounds served, a killed site rejoins after two missed heartbeats, the same rounds simulated
@pytest.mark.timeout(1500)
def test_three_sites_with_their_own_folders_train_rejoin_equal_the_simulation_and_export_alone(tmp_path, small_world):
    preset, simulation, disks = _presets(tmp_path, small_world)
    sites, new = _site_classes(small_world)
    assert "data" not in preset.read_text() and 'node_key = "../certs/node-1.pub"' in preset.read_text()
    certs = tmp_path / "certs"  # node-3: admitted, listed for no site (the impostor's)
    subprocess.run([*FEDMVP, "certs", "--out", str(certs), "--nodes", "4"], check=True, capture_output=True, env=ENV)
    port = free_port()
    procs = Processes(tmp_path)
    run = tmp_path / "runs" / "clinics"
    joins = {name: ["join", "--superlink", f"127.0.0.1:{port}", "--config", str(preset), "--data", str(folder),
                    "--name", name, "--root-certificates", str(certs / "ca.crt"), "--auth-key", str(certs / f"node-{i}")]
             for i, (name, folder) in enumerate(disks.items())}
    impostor = [*joins["site-b"][:-1], str(certs / "node-3")]  # site-b's name and folder, its own admitted key
    try:
        # min-nodes 3: every round waits for all three sites, so the killed one's round is tried again once it
        # is back, and every round's trajectory is the simulation's (all sites, every round)
        server = procs.start("serve", ["serve", "--config", str(preset), "--run-dir", str(run), "--certs", str(certs),
                                       "--node-keys", str(certs / "node-keys.txt"), "--address", f"127.0.0.1:{port}",
                                       "--min-nodes", "3", "--round-timeout", "90", "--eval-every", "1", "--json"])
        procs.wait_for("admitted node keys", lambda: "SuperNode keys admitted" in procs.log("serve"), 90)
        for name, args in [("impostor", impostor), *joins.items()]:
            procs.start(name, args)
        procs.wait_for("round 1", lambda: 1 in _states(run), 420)
        procs.kill("site-c")  # the site's machine dies: the join, its SuperNode and its executor
        starts = _rejoin(procs, "site-c", joins["site-c"], lambda: any(2 in s["sites"] for n, s in _states(run).items()
                                                                       if n > 1), 420)
        assert server.wait(timeout=scaled(420)) == 0, procs.log("serve")[-3000:] + procs.log("site-c")[-3000:]
    finally:
        procs.stop()
    print(f"site-c rejoined after {starts} start(s)")
    result = json_result(procs.log("serve"))
    assert result["status"] == "finished:completed" and result["rounds"] == list(range(1, ROUNDS + 1))
    # --json: each round as its line tells it (on stderr), and the results table's figures
    assert [(r["round"], r["replied"]) for r in result["round_log"]] == [(n, list(sites)) for n in range(1, ROUNDS + 1)]
    assert result["final"]["round"] == ROUNDS and set(result["final"]["tuned"]) >= set(ACCURACIES)
    assert re.search(r"round \d+: node \d+ is sent no work: site 1 'site-b' is bound to node_key "
                     r"'?\.\./certs/node-1\.pub'?; this node's proof does not verify", procs.log("serve")), \
        procs.log("serve")[-3000:]
    config = json.loads((run / "config.json").read_text())
    assert [c["train_images"] for c in config["federation"]["clients"]] == [None] * 3  # the server saw no image
    # 4 images a class, 1 held out (eval_fraction 0.2, ceil): 3 training images of each base class; the new
    # class's images are never trained on, so neither counted in examples nor among the classes
    expected = {i: (name, 3 * len([c for c in classes if c not in new]), {c: 3 for c in classes if c not in new})
                for i, (name, classes) in enumerate(sites.items())}
    assert expected[0][1] == 6 and new[0] not in expected[0][2]
    states = _states(run)
    assert sorted(states) == list(range(1, ROUNDS + 1))
    for number, state in states.items():
        assert state["rejected"] == [] and sorted(state["sites"]) == [0, 1, 2], (number, state)
        assert {r["site"]: (r["name"], r["examples"], r["classes"]) for r in state["replies"]} == expected, number
    # the killed site is back: rounds after the kill hold its site again, answered by the restarted join
    assert procs.procs["site-c"].returncode is not None and starts >= 1
    # the federated evaluation equals the simulation of the same folders
    sim_run = tmp_path / "runs" / "simulated"
    out = subprocess.run([*FEDMVP, "train", "--config", str(simulation), "--run-dir", str(sim_run), "--eval-every",
                          "1"], capture_output=True, text=True, timeout=scaled(900), env=ENV, cwd=tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    served, simulated = _rows(run), _rows(sim_run)
    for number in served:  # shown when an assertion below fails: what differed, and by how much
        print(f"round {number}: served {served[number]}\n         simulated {simulated.get(number)}")
    assert sorted(served) == sorted(simulated) == list(range(1, ROUNDS + 1))
    # the zero-shot row too: it waits, as round 1 does, for the sites (not whoever connected first)
    zero = [json.loads((r / "zero_shot.json").read_text()) for r in (run, sim_run)]
    assert zero[0]["local_sites"] == 3 and {k: zero[0].get(k) for k in ACCURACIES + SITE_COUNTS} == \
        {k: zero[1].get(k) for k in ACCURACIES + SITE_COUNTS}
    for number in served:
        got, want = served[number], simulated[number]
        assert got["eval_sites"] == 3 and got["clients"] == want["clients"] == 3, (number, got)
        assert {k: got[k] for k in ACCURACIES + SITE_COUNTS} == {k: want[k] for k in ACCURACIES + SITE_COUNTS}, number
        for key in LOSSES:  # the same sums in another order of processes: equal to float32 rounding
            assert math.isclose(got[key], want[key], rel_tol=1e-5), (number, key, got[key], want[key])
        sim_state = json.loads((sim_run / f"round-{number:04d}" / "state.json").read_text())
        assert {r["site"]: (r["name"], r["examples"], r["classes"]) for r in sim_state["replies"]} == expected
        # the same global model each round: this world's few test images hardly move the accuracies, the
        # weights show the two trajectories are one (bitwise equal where both train on one thread)
        weights = [load_file(r / f"round-{number:04d}" / "global.safetensors") for r in (run, sim_run)]
        assert sorted(weights[0]) == sorted(weights[1])
        for name, tensor in weights[0].items():
            np.testing.assert_allclose(tensor, weights[1][name], rtol=0, atol=1e-6, err_msg=f"round {number} {name}")
    # The served run alone: no site folder, no preset folder, a working directory without data.
    for folder in [*disks.values(), preset.parent, simulation.parent]:
        shutil.rmtree(folder)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = subprocess.run([*EXPORT, "--run", str(run), "--round", str(ROUNDS), "--out", str(elsewhere / "bundle"),
                          "--json"], cwd=elsewhere, capture_output=True, text=True, env=ENV, timeout=scaled(300))
    assert out.returncode == 0, out.stderr[-3000:]
    from fedmvp_formats.bundle_manifest import MANIFEST

    manifest = json.loads((elsewhere / "bundle" / MANIFEST).read_text())
    names = json.loads((run / "classes.json").read_text())["classes"]
    assert names[-1]["name"] == new[0] and len(names) == 8
    assert manifest["parity"]["fp32"]["passed"]
