"""Sites that hold only their own data, deployed (issue 24): `fedmvp serve` on a [federation] preset
with no image on the server, TLS with node authentication, two `fedmvp join --data` sites, each folder
holding only its own classes (one also a new class), no shared root; then `fedmvp-export` of the
served run from a directory without any data. One deployment serves every assertion (its cost)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fedmvp_apps.deploy.supernode import free_port
from tests.federated.processes import ENV, FEDMVP, Processes
from tests.site_trees import site_preset, world_classes

EXPORT = [*FEDMVP[:2], "fedmvp_apps.export_cli"]


def _deployment_preset(folder: Path, world: Path) -> tuple[Path, dict[str, Path], list[str]]:
    """The federation's preset as a deployment writes it ([[sites]] by name, no data), and each site's
    folder moved to a disk of its own: site-a holds 2 base classes and the new class, site-b 2 others."""
    seen, held = world_classes(world)
    (folder / "draft").mkdir()
    built = site_preset(folder / "draft", world, {"site-a": seen[:2] + held[:1], "site-b": seen[2:4]}, held[:1])
    disks = {}
    for name in ("site-a", "site-b"):
        disks[name] = folder / f"{name}-disk" / "images"
        shutil.move(str(built.parent / "sites" / name), disks[name])
    preset = folder / "server" / "clinics.toml"
    preset.parent.mkdir()
    shutil.copy(built.parent / "attributes.json", preset.parent / "attributes.json")
    preset.write_text(re.sub(r'data = "sites/[^"]+"\n', "", built.read_text()))
    shutil.rmtree(built.parent)
    return preset, disks, held[:1]


@pytest.mark.timeout(420)
def test_two_sites_with_their_own_folders_train_and_the_served_run_exports_alone(tmp_path, small_world):
    preset, disks, new = _deployment_preset(tmp_path, small_world)
    assert "data" not in preset.read_text()
    certs = tmp_path / "certs"
    subprocess.run([*FEDMVP, "certs", "--out", str(certs), "--nodes", "2"], check=True, capture_output=True, env=ENV)
    port = free_port()
    procs = Processes(tmp_path)
    run = tmp_path / "runs" / "clinics"
    try:
        server = procs.start("serve", ["serve", "--config", str(preset), "--run-dir", str(run), "--certs", str(certs),
                                       "--node-keys", str(certs / "node-keys.txt"), "--address", f"127.0.0.1:{port}",
                                       "--round-timeout", "120", "--json"])
        procs.wait_for("admitted node keys", lambda: "SuperNode keys admitted" in procs.log("serve"), 90)
        for i, (name, folder) in enumerate(disks.items()):
            procs.start(name, ["join", "--superlink", f"127.0.0.1:{port}", "--config", str(preset), "--data",
                               str(folder), "--name", name, "--root-certificates", str(certs / "ca.crt"),
                               "--auth-key", str(certs / f"node-{i}")])
        assert server.wait(timeout=360) == 0, procs.log("serve")[-3000:] + procs.log("site-a")[-3000:]
    finally:
        procs.stop()
    result = json.loads(procs.log("serve")[procs.log("serve").index("{\n"):])
    assert result["status"] == "finished:completed" and result["rounds"] == [1, 2]
    config = json.loads((run / "config.json").read_text())
    assert [c["train_images"] for c in config["federation"]["clients"]] == [None, None]  # the server saw no image
    for number in (1, 2):
        state = json.loads((run / f"round-{number:04d}" / "state.json").read_text())
        assert state["rejected"] == [] and sorted(state["sites"]) == [0, 1]
        replies = {r["site"]: r for r in state["replies"]}
        # 4 images a class, 1 held out (eval_fraction 0.2, ceil): 2 base classes x 3; never the new class's
        assert {s: (r["name"], r["examples"]) for s, r in replies.items()} == {0: ("site-a", 6), 1: ("site-b", 6)}
    assert json.loads((run / "round-0002" / "state.json").read_text())["metrics"]["new"] is not None
    # The served run alone: no site folder, no preset folder, a working directory without data.
    for folder in [*disks.values(), preset.parent]:
        shutil.rmtree(folder)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = subprocess.run([*EXPORT, "--run", str(run), "--round", "2", "--out", str(elsewhere / "bundle"), "--json"],
                         cwd=elsewhere, capture_output=True, text=True, env=ENV, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    from fedmvp_formats.bundle_manifest import MANIFEST

    manifest = json.loads((elsewhere / "bundle" / MANIFEST).read_text())
    names = json.loads((run / "classes.json").read_text())["classes"]
    assert names[-1]["name"] == new[0] and len(names) == 5
    assert manifest["parity"]["fp32"]["passed"]
