"""Real photographs' class names on the tiny CLIP, and a run evaluated at a site from its own record.

- `fedmvp train` on a preset whose classes are real photo names (scikit-image's: astronaut, camera, ...) on
  the shipped tiny CLIP says, in one warning line, that the model cannot tell them apart by text (every
  figure near chance) and what to use instead; the figures are in the run (vocabulary.json, --json). The
  demo's class set does not warn (docs/tutorials/one-machine.md "Your own class names on the tiny CLIP").
- A backbone that needs a download while downloads are off: one line naming the preset's key, exit 2,
  no run directory written.
- `fedmvp evaluate --run R --round N --data DIR` on a copy of the run with the server's attribute file gone:
  the class set is the run's own classes.json; the default --name works in an open run; no message shows
  the server's paths.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedmvp.attributes.prompt import offline_attributes
from tests.deadlines import scaled


PHOTO_CLASSES = ["astronaut", "camera", "coffee", "horse", "rocket"]  # rocket: held out (new)


def fedmvp(*args: object, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedmvp_apps.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=scaled(600), cwd=cwd, env={**os.environ, **(env or {})})


def photo_sites(root: Path, sites: dict[str, list[str]], per_class: int = 5) -> None:
    """Site folders root/sites/<site>/<class>/<n>.png of plain generated images: the warning is about text."""
    rng = np.random.default_rng(0)
    for site, classes in sites.items():
        for name in classes:
            folder = root / "sites" / site / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")


def photo_preset(root: Path, listed: bool = True, clip: str = "fedmvp-tiny", pretrained: str = "synthetic") -> Path:
    """A [federation] of the photo names (phrases from `fedmvp attributes generate --offline`), two sites."""
    photo_sites(root, {"north": PHOTO_CLASSES[:2] + ["rocket"], "south": PHOTO_CLASSES[2:4]})
    (root / "attributes.json").write_text(json.dumps({c: offline_attributes(c) for c in PHOTO_CLASSES}))
    lines = ['name = "photos"', "seed = 1", "[model]", f'clip = "{clip}"', f'pretrained = "{pretrained}"',
             "[train]", "rounds = 1", "local_epochs = 1", "batch_size = 4",
             "[federation]", 'attributes = "attributes.json"', 'new_classes = ["rocket"]']
    if listed:
        lines += ["[[sites]]", 'name = "north"', 'data = "sites/north"', "[[sites]]", 'name = "south"',
                  'data = "sites/south"']
    path = root / "photos.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
def test_train_on_real_photo_names_warns_once_and_records_the_figures(tmp_path):
    preset = photo_preset(tmp_path)
    out = fedmvp("train", "--config", preset, "--run-dir", tmp_path / "run", "--json")
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if "cannot tell" in line]
    assert len(warnings) == 1, out.stderr
    assert warnings[0].startswith("warning: fedmvp-tiny cannot tell these 5 classes apart by text (100% of their "
                                  "names' words unknown to its tokenizer, class text similarity 0.9")
    assert "every figure will sit near chance" in warnings[0] and "docs/howto/weights.md" in warnings[0]
    shown = json.loads(out.stdout)["vocabulary"]
    recorded = json.loads((tmp_path / "run" / "vocabulary.json").read_text())
    assert shown == recorded and recorded["warns"] and recorded["unknown_name_share"] == 1.0
    assert recorded["text_similarity"] > 0.95 and recorded["classes"] == 5
    # evaluate says it again from the record (no backbone loaded for it), and --json carries the figures
    again = fedmvp("evaluate", "--run", tmp_path / "run", "--json")
    assert again.returncode == 0, again.stderr
    assert [line for line in again.stderr.splitlines() if "cannot tell" in line] == warnings
    assert json.loads(again.stdout)["vocabulary"] == recorded


@pytest.mark.deployment  # starts a SuperNode (nothing answers it)
def test_join_says_the_warning_once_from_its_executor_before_it_tries_the_server(tmp_path):
    """A site's backbone checks run in its warm executor (fedmvp_apps.cli.join_preflight): the warning is
    still one line on the join's terminal, before the SuperNode starts."""
    from fedmvp_apps.deploy.supernode import free_port
    from tests.federated.processes import Processes

    preset = photo_preset(tmp_path)
    procs = Processes(tmp_path)
    try:
        procs.start("join", ["join", "--superlink", f"127.0.0.1:{free_port()}", "--insecure", "--config", str(preset),
                             "--data", str(tmp_path / "sites" / "north"), "--name", "north"])
        procs.wait_for("the address line", lambda: "trying the SuperLink" in procs.log("join"), 120, watch="join")
    finally:
        procs.stop()
    shown = procs.log("join")
    warnings = [line for line in shown.splitlines() if "cannot tell" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: fedmvp-tiny cannot tell these 5 classes"), shown
    assert shown.index("cannot tell") < shown.index("trying the SuperLink"), shown
    assert "fedmvp-preflight" not in shown, shown  # the executor's answer is read, not shown


def test_the_demo_class_set_does_not_warn(tmp_path, capsys):
    """The demo preset's run as `fedmvp train --config demo` starts it (prepare, then the check), no round run."""
    from fedmvp.federated.prepare import prepare_run
    from fedmvp_apps.cli.train import check_vocabulary

    run = prepare_run("demo", str(tmp_path / "demo"), None, resume=False, device="cpu")
    check_vocabulary(run)
    assert "cannot tell" not in capsys.readouterr().err
    recorded = json.loads((run.path / "vocabulary.json").read_text())
    assert recorded["classes"] == 40 and not recorded["warns"] and recorded["unknown_name_share"] == 0.0


@pytest.mark.processes  # a refusal (exit 2): no federation starts (tests/process_markers.py)
def test_weights_that_need_a_download_are_one_line_naming_the_presets_key_exit_2(tmp_path):
    preset = photo_preset(tmp_path, clip="ViT-B-16", pretrained="openai")
    out = fedmvp("train", "--config", preset, "--run-dir", tmp_path / "run",
                 env={"HF_HOME": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "FEDMVP_ALLOW_DOWNLOAD": "0"})
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {preset}: [model]: ViT-B-16 with pretrained 'openai' is "
                                                   "not in the local cache and downloads are off"), lines
    assert "[model] pretrained" in lines[0] and "docs/howto/weights.md" in lines[0]
    assert "--pretrained" not in lines[0]  # `fedmvp train` has no such flag
    assert not (tmp_path / "run").exists()  # nothing written


def server_run(root: Path, listed: bool) -> Path:
    """A deployment's run directory (the server's: its preset and attribute file beside it) with one round."""
    from fedmvp.federated.prepare import prepare_run
    from fedmvp.model import FedMVP

    preset = photo_preset(root, listed=listed, pretrained="")
    run = prepare_run(str(preset), str(root / "run"), None, resume=False, device="cpu", with_data=False)
    model = FedMVP.build(*run.clip_spec(), run.method(), run.seed)
    run.save_checkpoint(1, model.state("all"), {"lora_clients": [], "method": run.method().to_dict()})
    return run.path


@pytest.fixture(scope="module")
def open_run(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("server")
    return root, server_run(root, listed=False)


@pytest.mark.processes  # starts real processes (see pyproject.toml markers)
def test_evaluate_at_a_site_reads_the_copied_run_alone(open_run, tmp_path):
    server, served = open_run
    site = tmp_path / "site"
    run = site / "run"
    shutil.copytree(served, run)
    shutil.copytree(server / "sites" / "north", site / "data")  # the folder's name is not the site's
    moved = server.with_name(server.name + "-moved")  # the server's folder (preset, attribute file) is not here
    server.rename(moved)
    try:
        out = fedmvp("evaluate", "--run", run, "--round", 1, "--data", site / "data", "--json", cwd=site)
        wrong = fedmvp("evaluate", "--run", run, "--round", 1, "--data", site / "data", "--name", " ", cwd=site)
    finally:
        moved.rename(server)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["site"]["name"] == socket.gethostname()  # as `fedmvp join` names a site by default
    assert result["site"]["images"] == {"local": 2, "base": 2, "new": 5}  # 1 of 5 held out per base class
    assert str(server) not in out.stdout + out.stderr
    assert wrong.returncode == 2 and wrong.stderr.strip().splitlines() == [
        "error: --name ' ': a site name is 1 to 128 characters, not blank"], wrong.stderr


@pytest.mark.processes  # starts real processes (see pyproject.toml markers)
def test_evaluate_at_a_listed_site_asks_for_its_name_without_the_servers_paths(tmp_path):
    server = tmp_path / "server"
    server.mkdir()
    run = tmp_path / "site" / "run"
    shutil.copytree(server_run(server, listed=True), run)
    shutil.rmtree(server)
    out = fedmvp("evaluate", "--run", run, "--round", 1, "--data", tmp_path / "site" / "data")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"error: {run}: which site's folder is 'data'? Its name and this host's ({socket.gethostname()!r}) are none "
        f"of the run's sites ('north', 'south'): pass --name NAME"], out.stderr
