"""`fedmvp train` on a [federation] preset with [[sites]]: each site trains on its own folder (issue 24)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.site_trees import site_preset, world_classes
import pytest
from tests.deadlines import scaled

pytestmark = pytest.mark.processes  # the others: refusals (exit 2), no federation starts


@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
def test_sites_with_disjoint_folders_train_and_evaluate(tmp_path, small_world):
    seen, held = world_classes(small_world)
    preset = site_preset(tmp_path, small_world, {"site-a": seen[:2] + held[:1], "site-b": seen[2:4]}, held[:1])
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "fedmvp_apps.cli", "train", "--config", str(preset),
                          "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=scaled(600))
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    config = json.loads((run_dir / "config.json").read_text())
    clients = config["federation"]["clients"]
    assert [(c["name"], c["classes"]) for c in clients] == [("site-a", seen[:2]), ("site-b", seen[2:4])]
    # new-class images are never trained on: each site's examples are its base classes' training share
    assert [c["train_images"] for c in clients] == [2 * 3, 2 * 3]  # 4 images a class, 1 held out (0.2, ceil)
    state = json.loads((run_dir / "round-0002" / "state.json").read_text())
    assert state["complete"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and rows[-1]["new"] is not None and rows[-1]["base"] is not None
    # each site evaluates where its data is: both hold base classes, only site-a a new one (site-b adds
    # nothing to New, not a zero); the row says how many sites each metric is a mean over (issue 24 §3)
    counts = {k: rows[-1][k] for k in ("local_sites", "base_sites", "new_sites", "domain_sites", "hm_sites")}
    assert counts == {"local_sites": 2, "base_sites": 2, "new_sites": 1, "domain_sites": 0, "hm_sites": 2}
    zero_shot = json.loads((run_dir / "zero_shot.json").read_text())
    assert (zero_shot["new_sites"], zero_shot["base_sites"]) == (1, 2)
    shown = subprocess.run([sys.executable, "-m", "fedmvp_apps.cli", "evaluate", "--run", str(run_dir), "--json"],
                           capture_output=True, text=True, timeout=scaled(300))
    assert shown.returncode == 0, shown.stderr[-2000:]
    result = json.loads(shown.stdout)
    assert {k: result["tuned"][k] for k in counts} == counts and result["zero-shot"]["new_sites"] == 1


def test_a_site_folder_with_an_unknown_class_stops_before_anything_starts(tmp_path, small_world):
    seen, _ = world_classes(small_world)
    preset = site_preset(tmp_path, small_world, {"site-a": seen[:2], "site-b": seen[2:3]}, [])
    (tmp_path / "sites" / "site-b" / "zebra").mkdir()
    out = subprocess.run([sys.executable, "-m", "fedmvp_apps.cli", "train", "--config", str(preset),
                          "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=scaled(300))
    assert out.returncode == 2 and "zebra: class 'zebra' is not in the federation's class set" in out.stderr
    assert not (tmp_path / "run" / "round-0001").exists()


def test_join_refuses_a_bad_site_folder_before_connecting(tmp_path, small_world):
    seen, _ = world_classes(small_world)
    preset = site_preset(tmp_path, small_world, {"site-a": seen[:2]}, [])
    (tmp_path / "sites" / "site-a" / "zebra").mkdir()
    (tmp_path / "sites" / "site-a" / "empty").mkdir()
    out = subprocess.run([sys.executable, "-m", "fedmvp_apps.cli", "join", "--superlink", "127.0.0.1:1",
                          "--insecure", "--config", str(preset), "--data", str(tmp_path / "sites" / "site-a"),
                          "--name", "site-a"], capture_output=True, text=True, timeout=scaled(120))
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert [line.split(": ")[0] for line in lines] == ["error", "error"], lines
    assert "empty" in lines[0] and "zebra" in lines[1]


def test_join_refuses_a_name_the_preset_does_not_list_before_connecting(tmp_path, small_world):
    """A site's id is its place among [[sites]]: an unlisted --name is one line naming the preset and
    the listed names, exit 2, before any folder is read or anything connects."""
    seen, _ = world_classes(small_world)
    preset = site_preset(tmp_path, small_world, {"site-a": seen[:2], "site-b": seen[2:3]}, [])
    out = subprocess.run([sys.executable, "-m", "fedmvp_apps.cli", "join", "--superlink", "127.0.0.1:1",
                          "--insecure", "--config", str(preset), "--data", str(tmp_path / "sites" / "site-a"),
                          "--name", "site-c"], capture_output=True, text=True, timeout=scaled(120))
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and str(preset) in lines[0] and "'site-c'" in lines[0] and "site-a, site-b" in lines[0]
