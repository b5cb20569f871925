"""Edge devices in a real federation on 127.0.0.1 (TLS on): `fedmvp serve`, one site (`fedmvp join`)
and two devices (`edge-client join`) on exported bundles with their own local folders.

- The devices run on an edge install: `fedmvp` (the training core), open_clip and peft cannot
  be imported in their processes (a sitecustomize blocks them), yet they train and evaluate.
- The run resumes at round 2 for rounds 3 and 4. Device A's bundle is the export of round 2 (it
  holds the global PromptFormer), device B's of round 1 (stale): B refreshes its bundle in place
  before training, A does not; afterwards B's inference output has changed.
- The site trains the PromptFormer (sigma 0: it never switches to LoRA), so the global LoRA after
  each round is exactly the example-weighted mean of the devices' accepted replies (their update
  files, kept on each device).
- Device B is killed mid-way through round 4: the round closes at its timeout with the site and A.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from tests.deadlines import scaled
from tests.federated.conftest import write_preset
from tests.federated.processes import ENV, FEDMVP, Processes, json_result

pytestmark = pytest.mark.deployment  # starts a federation (see pyproject.toml markers)

BLOCKER = '''
import importlib.abc, sys

class _EdgeInstall(importlib.abc.MetaPathFinder):
    """An edge install: neither the training core nor open_clip nor peft is there."""
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fedmvp", "open_clip", "peft"):
            raise ImportError(f"{name} is not installed on this edge device (blocked by the test)")
        return None

sys.meta_path.insert(0, _EdgeInstall())
'''


def prepare_run(tmp_path: Path, world: Path, rounds: int = 4, extra: str = "") -> tuple[Path, Path]:
    """A run of ``rounds`` rounds with rounds 1 and 2 done (different PromptFormers), the site never
    switching; ``extra``: TOML appended to the preset (a [server] table)."""
    from fedmvp.federated.prepare import prepare_run as prepare
    from fedmvp.model import FedMVP

    preset = write_preset(tmp_path, world, sigma=0.0)
    preset.write_text(preset.read_text().replace('pretrained = ""', 'pretrained = "synthetic"') + extra)
    run = prepare(str(preset), str(tmp_path / "runs" / "edge"), rounds, resume=False, device="cpu")
    config = run.read_config()
    model = FedMVP.from_run(run, 0)  # the run's initial model
    state = model.state("all")
    generator = torch.Generator().manual_seed(5)
    for number in (1, 2):
        state = {k: v + 0.02 * torch.randn(v.shape, generator=generator) for k, v in state.items()}
        run.save_checkpoint(number, state, {"lora_clients": [], "seed": config["seed"], "lr": config["lr"],
                                            "total_rounds": rounds, "method": config["method"], "sites": [0]})
    return preset, run.path


def local_folder(world: Path, classes: list[str], per_class: int, out: Path) -> Path:
    """DEVICE/<class>/<image>: the world's photo images of ``classes``."""
    for name in classes:
        found = sorted((world / "photo").glob(f"*/{name}/*.png"))[:per_class]
        assert len(found) == per_class, name
        (out / name).mkdir(parents=True)
        for i, path in enumerate(found):
            shutil.copy(path, out / name / f"{i}.png")
    return out


def update_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("update-*.safetensors"), key=lambda p: p.stat().st_mtime_ns)


def states(run: Path) -> dict[int, dict]:
    return {int(p.parent.name.split("-")[1]): json.loads(p.read_text()) for p in sorted(run.glob("round-*/state.json"))}


def logits(bundle: Path, image: Path) -> np.ndarray:
    from edge_client.infer import Predictor

    predictor = Predictor(bundle, personalised=False)
    return predictor.run(predictor.decode(image)[0][None])["logits"][0]


@pytest.mark.slow  # three versions of edge devices, one killed and restarted
@pytest.mark.timeout(600)
def test_edge_devices_join_train_refresh_and_survive_a_kill(tmp_path, small_world):
    from export.bundle_writer import export_bundle
    from fedmvp_apps.deploy.supernode import free_port
    from fedmvp.federated.wire import promptformer_digest

    preset, run = prepare_run(tmp_path, small_world)
    bundles = {"a": tmp_path / "device-a" / "bundle", "b": tmp_path / "device-b" / "bundle"}
    export_bundle(run, 2, bundles["a"])
    export_bundle(run, 1, bundles["b"])
    from edge_client.bundle import Bundle

    classes = Bundle.open(bundles["a"]).class_names
    data = {"a": local_folder(small_world, classes[:3], 4, tmp_path / "device-a" / "local"),
            "b": local_folder(small_world, classes[2:4], 4, tmp_path / "device-b" / "local")}
    probe = next((data["b"] / classes[2]).iterdir())
    before_b = logits(bundles["b"], probe)

    blocker = tmp_path / "edge-install"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    certs = tmp_path / "certs"
    subprocess.run([*FEDMVP, "certs", "--out", str(certs)], check=True, capture_output=True, env=ENV)
    port = free_port()
    procs = Processes(tmp_path)
    # the blocker first; then the checkout under test, where PYTHONPATH names one (else the installed tree runs)
    edge_env = {**ENV, "PYTHONPATH": os.pathsep.join(p for p in (str(blocker), ENV.get("PYTHONPATH")) if p)}
    edge_client = str(Path(sys.executable).parent / "edge-client")
    try:
        procs.start("serve", ["serve", "--config", str(preset), "--run-dir", str(run), "--certs", str(certs),
                              "--allow-any-node", "--address", f"127.0.0.1:{port}", "--min-nodes", "2",
                              "--round-timeout", "60", "--json"])
        procs.wait_for("SuperLink", lambda: "SuperLink listening" in procs.log("serve"), 60)
        procs.start("site-0", ["join", "--superlink", f"127.0.0.1:{port}", "--config", str(preset),
                               "--root-certificates", str(certs / "ca.crt"), "--site", "0"])
        for name in ("a", "b"):
            procs.start(f"edge-{name}", ["--superlink", f"127.0.0.1:{port}", "--bundle", str(bundles[name]),
                                         "--data", str(data[name]), "--root-certificates", str(certs / "ca.crt"),
                                         "--out", str(tmp_path / f"device-{name}" / "updates"), "--epochs", "1",
                                         "--lr", "0.01", "--optimizer", "adamw", "--eval-fraction", "0.25",
                                         "--threads", "1", *(["--personalise"] if name == "a" else [])],
                        command=[edge_client, "join"], env=edge_env)
        procs.wait_for("round 3", lambda: 3 in states(run), 300)
        procs.kill("edge-b")  # round 4 is under way: device B never answers it
        assert procs.procs["serve"].wait(timeout=scaled(300)) == 0, procs.log("serve")[-3000:]
    finally:
        procs.stop()
    result = json_result(procs.log("serve"))
    assert result["status"] == "finished:completed", result
    assert "not installed on this edge device" not in procs.log("edge-a") + procs.log("edge-b")

    round3, round4 = states(run)[3], states(run)[4]
    edges3 = sorted((r for r in round3["replies"] if r["role"] == "edge"), key=lambda r: r["examples"])
    assert [r["role"] for r in round3["replies"]].count("site") == 1 and len(edges3) == 2
    # B holds 2 classes x 3 training images, A 3 classes x 3: the reply weights are what they trained on.
    assert [r["examples"] for r in edges3] == [6, 9]
    by_examples = {6: "b", 9: "a"}
    assert {by_examples[r["examples"]]: r["refreshed"] for r in edges3} == {"a": False, "b": True}
    assert {by_examples[r["examples"]]: r["refresh_bytes"] > 0 for r in edges3} == {"a": False, "b": True}

    files = {name: update_files(tmp_path / f"device-{name}" / "updates") for name in ("a", "b")}
    assert len(files["a"]) == 2 and len(files["b"]) == 1, files
    updates3 = {name: load_file(str(files[name][0])) for name in ("a", "b")}
    global3 = load_file(str(run / "round-0003" / "global.safetensors"))
    for key in updates3["a"]:
        mean = (9 * updates3["a"][key].astype(np.float64) + 6 * updates3["b"][key].astype(np.float64)) / 15
        np.testing.assert_allclose(global3[key], mean.astype(np.float32), rtol=1e-6, atol=1e-7)
    # Round 4: B was killed; the round closed with the site and A alone, once the SuperLink took B for gone.
    assert sorted(r["role"] for r in round4["replies"]) == ["edge", "site"]
    # B counted once: timed out, or left out under its own node id when the SuperLink (node 1) answered for it
    assert len(round4["rejected"]) + len(round4["timed_out"]) == 1 and all(r["node"] != 1 for r in round4["rejected"])
    global4 = load_file(str(run / "round-0004" / "global.safetensors"))
    update4 = load_file(str(files["a"][1]))
    for key, value in update4.items():
        assert np.array_equal(global4[key], value)
    # The PromptFormer is the site's (it never switched); the devices' bundles follow it.
    assert promptformer_digest(global4) != promptformer_digest(global3)
    refreshed = Bundle.open(bundles["b"])
    assert refreshed.round in (2, 3) and (bundles["b"] / "previous").is_dir()
    assert refreshed.promptformer_digest == promptformer_digest(
        load_file(str(run / f"round-{refreshed.round:04d}" / "global.safetensors")))
    assert not np.allclose(logits(bundles["b"], probe), before_b)
    # Device A joined with --personalise: each refresh moved its LoRA aside and the node re-applied it, saying
    # so; the join ends with A's own LoRA active on its refreshed bundle (docs/howto/refresh.md).
    from edge_client.lora_store import active_lora

    assert "moved the personalised LoRA aside" in procs.log("edge-a"), procs.log("edge-a")[-3000:]
    assert "re-applied on the refreshed bundle" in procs.log("edge-a")
    assert active_lora(Bundle.open(bundles["a"])).personalised
    # The last round's federated evaluation: the site's metrics and device A's held-out accuracy.
    row = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert row["round"] == 4 and row["edges"] == 1 and row["edge_devices"] >= 1 and 0 <= row["edge_acc"] <= 1
