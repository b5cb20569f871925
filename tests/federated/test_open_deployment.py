"""Open membership deployed (issue 24): `fedmvp serve` on a [federation] preset that lists no site, two
`fedmvp join --data DIR --name NAME` sites whose names are written nowhere before they join, two rounds
on 127.0.0.1. The server numbers the names in order of first appearance (RUN/sites.json), records each
site's examples and classes per round under that id, and the run alone exports."""

from __future__ import annotations

import json
import subprocess

import pytest

from fedmvp_apps.deploy.supernode import free_port
from tests.federated.processes import ENV, FEDMVP, Processes
from tests.site_trees import site_preset, world_classes

pytestmark = pytest.mark.processes  # starts real processes (see pyproject.toml markers)

ROUNDS = 2


@pytest.mark.timeout(900)
def test_two_unlisted_sites_are_numbered_train_and_the_run_exports(tmp_path, small_world):
    seen, held = world_classes(small_world)
    sites = {"north-ward": seen[:2] + held[:1], "south-ward": seen[2:4]}
    preset = site_preset(tmp_path, small_world, sites, held[:1], rounds=ROUNDS, listed=False)
    assert "ward" not in preset.read_text()  # no site is named anywhere before it joins
    port, run = free_port(), tmp_path / "runs" / "open"
    procs = Processes(tmp_path)

    def join(name: str) -> None:
        procs.start(name, ["join", "--superlink", f"127.0.0.1:{port}", "--insecure", "--config", str(preset),
                           "--data", str(tmp_path / "sites" / name), "--name", name, "--threads", "1"])

    def numbered() -> list[str]:
        path = run / "sites.json"
        return [s["name"] for s in json.loads(path.read_text())["sites"]] if path.exists() else []

    try:
        server = procs.start("serve", ["serve", "--config", str(preset), "--run-dir", str(run), "--insecure",
                                       "--address", f"127.0.0.1:{port}", "--min-nodes", "2", "--round-timeout", "120",
                                       "--eval-every", "1", "--json"])
        join("south-ward")  # first to appear: id 0
        procs.wait_for("south-ward numbered", lambda: numbered() == ["south-ward"], 300)
        join("north-ward")
        assert server.wait(timeout=600) == 0, procs.log("serve")[-3000:] + procs.log("north-ward")[-2000:]
    finally:
        procs.stop()
    assert numbered() == ["south-ward", "north-ward"]
    # per round, each site under its id and name: its examples (base-class training images: 4 a class, 1 held
    # out) and classes as counts; the new class only evaluated
    expected = {0: ("south-ward", 6, {c: 3 for c in seen[2:4]}), 1: ("north-ward", 6, {c: 3 for c in seen[:2]})}
    for number in range(1, ROUNDS + 1):
        state = json.loads((run / f"round-{number:04d}" / "state.json").read_text())
        assert state["rejected"] == [] and sorted(state["sites"]) == [0, 1], state
        assert {r["site"]: (r["name"], r["examples"], r["classes"]) for r in state["replies"]} == expected
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    assert {k: rows[-1][k] for k in ("clients", "eval_sites", "local_sites", "base_sites", "new_sites")} == \
        {"clients": 2, "eval_sites": 2, "local_sites": 2, "base_sites": 2, "new_sites": 1}
    # the run alone exports: its class set is the attribute file's, recorded when the run was made
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = subprocess.run([*FEDMVP[:2], "fedmvp_apps.export_cli", "--run", str(run), "--round", str(ROUNDS), "--out",
                          str(elsewhere / "bundle"), "--inference-only", "--json"], cwd=elsewhere, capture_output=True,
                         text=True, env=ENV, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    from fedmvp_formats.bundle_manifest import MANIFEST

    manifest = json.loads((elsewhere / "bundle" / MANIFEST).read_text())
    assert manifest["classes"]["names"] == [*seen[:4], held[0]] and manifest["parity"]["fp32"]["passed"]
