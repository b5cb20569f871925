"""Open membership deployed (docs/howto/open-federation.md): `fedmvp serve` on a [federation] preset that lists no site, two
`fedmvp join --data DIR --name NAME` sites whose names are written nowhere before they join, two rounds
on 127.0.0.1. The server numbers the names in order of first appearance (RUN/sites.json), records each
site's examples and classes per round under that id, and the run alone exports. One site (north-ward)
holds no copy of the run's attribute file: it joins with --classes-from-server from its own copy of the
preset, says it took the class set from the server, and its replies are accepted as the other's. What the
operator reads of `serve` without a terminal: one line per round, then the results table."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from fedmvp_apps.deploy.supernode import free_port
from tests.deadlines import scaled
from tests.federated.processes import ENV, FEDMVP, Processes
from tests.site_trees import site_preset, world_classes

pytestmark = pytest.mark.deployment  # starts a federation (see pyproject.toml markers)

ROUNDS = 2


@pytest.mark.timeout(900)
def test_two_unlisted_sites_are_numbered_train_and_the_run_exports(tmp_path, small_world):
    seen, held = world_classes(small_world)
    sites = {"north-ward": seen[:2] + held[:1], "south-ward": seen[2:4]}
    preset = site_preset(tmp_path, small_world, sites, held[:1], rounds=ROUNDS, listed=False)
    assert "ward" not in preset.read_text()  # no site is named anywhere before it joins
    port, run = free_port(), tmp_path / "runs" / "open"
    procs = Processes(tmp_path)

    bare = tmp_path / "north-machine" / preset.name  # the preset without its attributes.json beside it
    bare.parent.mkdir()
    bare.write_text(preset.read_text())

    def join(name: str, *flags: str) -> None:
        procs.start(name, ["join", "--superlink", f"127.0.0.1:{port}", "--insecure", "--config",
                           str(bare if flags else preset), "--data", str(tmp_path / "sites" / name), "--name", name,
                           "--threads", "1", *flags], env={**ENV, "FEDMVP_CACHE": str(tmp_path / f"{name}-cache")})

    def numbered() -> list[str]:
        path = run / "sites.json"
        return [s["name"] for s in json.loads(path.read_text())["sites"]] if path.exists() else []

    try:
        server = procs.start("serve", ["serve", "--config", str(preset), "--run-dir", str(run), "--insecure",
                                       "--address", f"127.0.0.1:{port}", "--min-nodes", "2", "--round-timeout", "120",
                                       "--eval-every", "1"])  # its stdout a file: a line per round, the table
        join("south-ward")  # first to appear: id 0
        procs.wait_for("south-ward numbered", lambda: numbered() == ["south-ward"], 300)
        join("north-ward", "--classes-from-server")
        assert server.wait(timeout=scaled(600)) == 0, procs.log("serve")[-3000:] + procs.log("north-ward")[-2000:]
    finally:
        procs.stop()
    assert numbered() == ["south-ward", "north-ward"]
    digest = json.loads((run / "classes.json").read_text())["digest"]
    took = [line for line in procs.log("north-ward").splitlines() if "took the class set" in line]
    assert took == [f"took the class set from the server (digest {digest[:12]}, 5 classes)"], \
        procs.log("north-ward")[-3000:]
    assert [p.name for p in (tmp_path / "north-ward-cache" / "classes").iterdir()] == [f"{digest}.json"]
    # per round, each site under its id and name: its examples (base-class training images: 4 a class, 1 held
    # out) and classes as counts; the new class only evaluated
    expected = {0: ("south-ward", 6, {c: 3 for c in seen[2:4]}), 1: ("north-ward", 6, {c: 3 for c in seen[:2]})}
    for number in range(1, ROUNDS + 1):
        state = json.loads((run / f"round-{number:04d}" / "state.json").read_text())
        assert state["rejected"] == [] and sorted(state["sites"]) == [0, 1], state
        assert state["timed_out"] == [] and 0 < state["seconds"] < 600, state  # sent, never replied; sent to aggregated
        assert {r["site"]: (r["name"], r["examples"], r["classes"]) for r in state["replies"]} == expected
    # the operator's log (no terminal): one line per round as it completed, then the table `fedmvp train` ends with
    from fedmvp.federated.evaluation import evaluate_run, format_table
    from fedmvp.runs import RunDir

    log = procs.log("serve")
    lines = [re.search(rf"^round {n}/{ROUNDS}: replied 2 \(south-ward, north-ward\), left out 0, timed out 0; "
                       rf"loss \d+\.\d{{4}}; Local [\d.]+, Base [\d.]+, New [\d.-]+, HM [\d.-]+; \d+\.\d s$", log, re.M)
             for n in range(1, ROUNDS + 1)]
    assert all(lines), log[-3000:]
    table = format_table(evaluate_run(RunDir(run)))
    assert table.startswith(f"round {ROUNDS} of {run}") and f"\n{table}\n\nrun directory: {run}" in log, log[-3000:]
    assert lines[0].start() < lines[1].start() < log.index(table)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    assert {k: rows[-1][k] for k in ("clients", "eval_sites", "local_sites", "base_sites", "new_sites")} == \
        {"clients": 2, "eval_sites": 2, "local_sites": 2, "base_sites": 2, "new_sites": 1}
    # the run alone exports: its class set is the attribute file's, recorded when the run was made
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = subprocess.run([*FEDMVP[:2], "fedmvp_apps.export_cli", "--run", str(run), "--round", str(ROUNDS), "--out",
                          str(elsewhere / "bundle"), "--inference-only", "--json"], cwd=elsewhere, capture_output=True,
                         text=True, env=ENV, timeout=scaled(300))
    assert out.returncode == 0, out.stderr[-3000:]
    from fedmvp_formats.bundle_manifest import MANIFEST

    manifest = json.loads((elsewhere / "bundle" / MANIFEST).read_text())
    assert manifest["classes"]["names"] == [*seen[:4], held[0]] and manifest["parity"]["fp32"]["passed"]
