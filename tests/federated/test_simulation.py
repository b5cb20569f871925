"""Federated training on Flower's simulation engine, end to end, and resume after a kill."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from fedmvp_apps.cli import main
from tests.deadlines import scaled


FEDMVP = [sys.executable, "-m", "fedmvp_apps.cli"]


def train(preset: Path, run_dir: Path, *extra: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([*FEDMVP, "train", "--config", str(preset), "--run-dir", str(run_dir), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **kwargs)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    out, _ = proc.communicate(timeout=scaled(timeout))
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory, small_world):
    """(preset, run directory, what `fedmvp train` printed) of one uninterrupted run."""
    from tests.federated.conftest import write_preset

    folder = tmp_path_factory.mktemp("fed")
    preset = write_preset(folder, small_world)
    run_dir = folder / "uninterrupted"
    return preset, run_dir, finish(train(preset, run_dir))


@pytest.fixture(scope="module")
def finished_run(trained):
    return trained[:2]


@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
def test_train_ends_with_the_table_demo_and_evaluate_print(trained):
    """Issue 27: `fedmvp train` ends with the Local/Base/New/HM table of its last round, the same lines
    `fedmvp evaluate` prints (one format_table, and echo_run_table shared with `fedmvp demo`)."""
    _, run_dir, printed = trained
    shown = CliRunner().invoke(main, ["evaluate", "--run", str(run_dir)])
    assert shown.exit_code == 0, shown.output
    table = shown.output.strip().splitlines()
    assert table[0] == f"round 3 of {run_dir}" and table[2].startswith("zero-shot") and table[3].startswith("tuned")
    tail = printed.strip().splitlines()[-(len(table) + 2):]
    assert tail[:len(table)] == table, printed[-2000:]
    assert tail[-1].startswith(f"run directory: {run_dir}")


@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
def test_run_directory_has_config_checkpoints_metrics_and_plot(finished_run):
    _, run_dir = finished_run
    assert [p.name for p in sorted(run_dir.glob("round-*"))] == ["round-0001", "round-0002", "round-0003"]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["rounds"] == 3 and config["num_clients"] == 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert rows[0]["lora_clients"] == 2  # both switched after round 1 (sigma is huge)
    assert all(0.0 <= rows[-1][k] <= 1.0 for k in ("local", "base", "new", "hm"))
    assert (run_dir / "metrics.csv").read_text().startswith("round,train_loss")
    assert (run_dir / "accuracy.png").read_bytes()[:4] == b"\x89PNG"
    state = json.loads((run_dir / "round-0003" / "state.json").read_text())
    assert state["complete"] and state["lora_clients"] == [0, 1]


@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
def test_lora_only_rounds_leave_the_promptformer_unchanged(finished_run):
    _, run_dir = finished_run
    r1 = load_file(str(run_dir / "round-0001" / "global.safetensors"))
    r3 = load_file(str(run_dir / "round-0003" / "global.safetensors"))
    for key in r1:
        if key.startswith("promptformer."):
            assert (r1[key] == r3[key]).all(), key
    assert any(not (r1[k] == r3[k]).all() for k in r1 if k.startswith("lora.") and "lora_B" in k)


@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
def test_preset_method_travels_to_checkpoints_bundle_and_update_files(finished_run, small_world, tmp_path):
    """The preset's lora_rank = 4 and alpha = 5 shape every LoRA tensor from the first checkpoint to the
    device's update file, and the method record travels with them (config.json, state.json, manifest)."""
    from edge_client.bundle import read_bundle
    from edge_client.train import train_local
    from edge_client.update import read_update
    from export.bundle_writer import ExportOptions, export_bundle

    _, run_dir = finished_run
    expected = {"lora_rank": 4, "alpha": 5.0}
    config = json.loads((run_dir / "config.json").read_text())
    assert {k: config["method"][k] for k in expected} == expected
    for round_dir in sorted(run_dir.glob("round-*")):
        state = json.loads((round_dir / "state.json").read_text())
        assert state["method"] == config["method"]
        lora = {k: v for k, v in load_file(str(round_dir / "global.safetensors")).items() if "lora_" in k}
        assert len(lora) == 6 and all(4 in v.shape for v in lora.values())
        assert all(v.shape[0] == 4 for k, v in lora.items() if "lora_A" in k)
    bundle = read_bundle(export_bundle(run_dir, 3, tmp_path / "bundle", ExportOptions(parity_images=32)).path)
    assert bundle.method == config["method"]
    assert all(4 in shape for shape in bundle.lora_shapes.values())
    data = tmp_path / "local"
    for name in bundle.class_names[:2]:  # a few training images of two bundle classes
        (data / name).mkdir(parents=True)
        for src in sorted((small_world / "photo" / "train" / name).glob("*.png")):
            shutil.copyfile(src, data / name / src.name)
    result = train_local(data, bundle, epochs=1, batch_size=4, out=tmp_path / "updates", apply=False)
    assert result.alpha == 5.0
    update = read_update(result.update_path, bundle)
    assert {k: list(v.shape) for k, v in update.tensors.items()} == bundle.lora_shapes


@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
def test_killed_mid_round_resume_matches_uninterrupted_run(finished_run, tmp_path):
    preset, reference = finished_run
    run_dir = tmp_path / "killed"
    proc = train(preset, run_dir)
    deadline = time.time() + scaled(240)
    while not (run_dir / "round-0001" / "state.json").exists():
        assert proc.poll() is None and time.time() < deadline, "round 1 never completed"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "round-0003").exists()
    finish(train(preset, run_dir, "--resume"))
    for name in ("global.safetensors",):
        assert (run_dir / "round-0003" / name).read_bytes() == (reference / "round-0003" / name).read_bytes()
    ours = json.loads((run_dir / "round-0003" / "state.json").read_text())
    theirs = json.loads((reference / "round-0003" / "state.json").read_text())
    assert ours["lora_clients"] == theirs["lora_clients"] and ours["metrics"] == theirs["metrics"]


@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
def test_evaluate_prints_the_paper_table(finished_run):
    _, run_dir = finished_run
    result = CliRunner().invoke(main, ["evaluate", "--run", str(run_dir)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[1].split()[:4] == ["Local", "Base", "New", "HM"]
    assert lines[2].startswith("zero-shot") and lines[3].startswith("tuned")
    assert lines[4].startswith("both rows over: Local 2 sites, 4 classes, ")  # what stands behind each column
    data = json.loads(CliRunner().invoke(main, ["evaluate", "--run", str(run_dir), "--json"]).output)
    assert data["round"] == 3 and set(data["tuned"]) >= {"local", "base", "new", "hm"}
    assert data["population"]["zero-shot"] == data["population"]["tuned"] and "note" not in data
    missing = CliRunner().invoke(main, ["evaluate", "--run", str(run_dir), "--round", "9"])
    assert missing.exit_code == 2 and "complete rounds: 1, 2, 3" in missing.output


@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
def test_evaluate_pairs_zero_shot_with_the_sites_that_evaluated_the_round(finished_run, tmp_path):
    """A site gone before a round's evaluation (its reply never came: eval_replies leaves it out): the
    table says the populations differ and both rows are over the sites that evaluated the round, zero-shot
    combined again from its recorded per-site counts; --json keeps the unpaired rows beside them."""
    from fedmvp.federated.metrics import combine_counts, counted, recorded_counts

    _, run_dir = finished_run
    run = shutil.copytree(run_dir, tmp_path / "run")
    record = json.loads((run / "config.json").read_text())["federation"]
    zero_shot = json.loads((run / "zero_shot.json").read_text())
    state_path = run / "round-0003" / "state.json"
    state = json.loads(state_path.read_text())
    tuned = recorded_counts(state["metrics"])
    assert sorted(tuned) == sorted(recorded_counts(zero_shot)) == [0, 1]
    del tuned[1]  # site 1 died before round 3 was evaluated
    state["metrics"] |= counted(record, tuned)
    state_path.write_text(json.dumps(state))
    paired = combine_counts(record, {0: recorded_counts(zero_shot)[0]})
    shown = CliRunner().invoke(main, ["evaluate", "--run", str(run)])
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    assert lines[2].split()[:2] == ["zero-shot", f"{100 * paired['local']:.2f}"] != \
        ["zero-shot", f"{100 * zero_shot['local']:.2f}"]
    assert lines[4].startswith("both rows over: Local 1 site, 2 classes, ")
    assert lines[5].startswith("populations differ: the tuned evaluation lacks site 1 (shapes/photo/base-1); both "
                               "rows above are over the 1 site both evaluated; as recorded: zero-shot Local ")
    data = json.loads(CliRunner().invoke(main, ["evaluate", "--run", str(run), "--json"]).output)
    assert data["zero-shot"]["local"] == paired["local"]
    assert data["unpaired"]["zero-shot"]["local"] == zero_shot["local"]
    assert data["population"]["zero-shot"]["local"] == data["population"]["tuned"]["local"] == \
        {"sites": 1, "classes": 2, "images": tuned[0]["local"][1]}


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.replace("shots = 2", "shots = 2\nwarmup = 3"), "unknown key 'warmup'"),
    (lambda s: s.replace('root = "', 'root = "/nonexistent'), "/nonexistent"),
    (lambda s: s.replace("classes_per_client = 2", "classes_per_client = 2\nnum_clients = 1"), "no client"),
])
def test_bad_preset_stops_before_training_with_one_line(preset_file, tmp_path, edit, message):
    preset_file.write_text(edit(preset_file.read_text()))
    result = CliRunner().invoke(main, ["train", "--config", str(preset_file), "--run-dir", str(tmp_path / "r")])
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
def test_existing_run_needs_resume(finished_run):
    preset, run_dir = finished_run
    result = CliRunner().invoke(main, ["train", "--config", str(preset), "--run-dir", str(run_dir)])
    assert result.exit_code == 2 and "--resume" in result.output


@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
def test_federated_evaluation_equals_the_central_one(finished_run):
    """Each site's counts on its own data, combined by the server, give the central numbers exactly."""
    import torch

    from fedmvp.federated.evaluation import evaluate_global, site_counts
    from fedmvp.federated.metrics import SITE_COUNT_KEYS, combine_counts, evaluation_sites
    from fedmvp.federated.task import task_context
    from fedmvp.runs import RunDir

    _, run_dir = finished_run
    run = RunDir(run_dir)
    config, checkpoint = run.read_config(), run.load_checkpoint(3)
    ctx = task_context(config["preset_path"], run.method(checkpoint))
    record = config["federation"]
    assignment = evaluation_sites(record)
    assert sorted(assignment) == sorted(e["name"] for e in record["evaluations"])
    for state in (checkpoint.tensors, None):  # tuned and zero-shot
        per_site = {c["id"]: site_counts(ctx, c["id"], state, assignment) for c in record["clients"]}
        assert all(set(counts) - {"local"} <= {n for n, s in assignment.items() if s == site}
                   for site, counts in per_site.items())  # a site evaluates only what is assigned to it
        torch.manual_seed(0)
        assert combine_counts(record, per_site) == evaluate_global(ctx, state)
    tuned = {k: v for k, v in json.loads((run_dir / "round-0003" / "state.json").read_text())["metrics"].items()
             if k in ("local", "base", "new", "hm", "domain", *SITE_COUNT_KEYS)}
    assert tuned == combine_counts(record, {c["id"]: site_counts(ctx, c["id"], checkpoint.tensors, assignment)
                                            for c in record["clients"]})


@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
@pytest.mark.timeout(300)
def test_a_site_sending_nan_is_left_out_and_the_rest_is_averaged_exactly(world6, tmp_path):
    """End to end on Flower, three sites: site 1's replies are all NaN (tests/federated/nan_client.py,
    which also records every reply). The server rejects them and records why; each round's global
    tensors are the example-weighted mean of the accepted replies (sites 0 and 2). Each left-out reply is
    said on stderr as it happens, in the words of its state.json record."""
    import numpy as np
    from safetensors import safe_open

    from fedmvp.federated.replies import left_out_line
    from tests.federated.conftest import three_site_preset

    preset = three_site_preset(tmp_path, world6)
    preset.write_text(preset.read_text() + "\n[server]\nmin_nodes = 2\n")
    run_dir, replies = tmp_path / "nan", tmp_path / "replies"
    replies.mkdir()
    script = ("from fedmvp.federated.prepare import prepare_run\nfrom fedmvp.federated.simulation import simulate\n"
              "from tests.federated.nan_client import app\n"
              f"simulate(prepare_run({str(preset)!r}, {str(run_dir)!r}, None, False, 'cpu'), progress=False, "
              "client_app=app)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True, timeout=scaled(280),
                          env={**os.environ, "FEDMVP_TEST_REPLIES": str(replies)})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    previous, recorded = None, []
    for number in (1, 2):
        state = json.loads((run_dir / f"round-{number:04d}" / "state.json").read_text())
        assert state["sites"] == [0, 2]
        assert [(r["site"], "NaN" in r["reason"]) for r in state["rejected"]] == [(1, True)]
        recorded += [left_out_line(number, r) for r in state["rejected"]]
        checkpoint = run_dir / f"round-{number:04d}" / "global.safetensors"
        tensors = {k: v.numpy() for k, v in load_file(str(checkpoint)).items()}
        sums: dict = {}
        weights: dict = {}
        for site in (0, 2):
            with safe_open(str(replies / f"r{number}-s{site}.safetensors"), "np") as f:
                weight = float(f.metadata()["num_examples"])
                for key in f.keys():
                    sums[key] = sums.get(key, 0.0) + f.get_tensor(key).astype(np.float64) * weight
                    weights[key] = weights.get(key, 0.0) + weight
        assert sums  # something was averaged
        for key, value in tensors.items():
            assert np.isfinite(value).all()
            if key in sums:
                assert np.array_equal(value, (sums[key] / weights[key]).astype(np.float32)), key
            elif previous is not None:  # a tensor nobody sent keeps its global value
                assert np.array_equal(value, previous[key]), key
        previous = tensors
    # each left-out reply was said as it happened, in the words of its state.json record
    assert [line for line in done.stderr.splitlines() if " left out the reply of " in line] == recorded
    assert all(line.startswith("round ") and "site 1 (node " in line for line in recorded), recorded


@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
@pytest.mark.timeout(300)
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs a thread count that differs from Ray's one per actor")
def test_the_server_asks_only_the_sampled_sites_and_each_node_its_site_once(world6, tmp_path):
    """Simulation samples sites as a deployment does: a third of three sites per round, their nodes
    alone get the round's message (no broadcast, no empty replies); each node is asked who it is once
    (its partition-id) and every site evaluates its own data; the thread count the simulation allots
    each node reaches the node in the message."""
    from fedmvp.federated.sampling import sample_sites
    from tests.federated.conftest import three_site_preset

    preset = three_site_preset(tmp_path, world6, rounds=3)
    preset.write_text(preset.read_text().replace("[train]\n", "[train]\nfraction_fit = 0.34\n"))
    run_dir, record = tmp_path / "sampled", tmp_path / "record"
    record.mkdir()
    cpus = max(1, (os.cpu_count() or 1) // 2)  # each node's share: 2 threads (a Ray actor's default is 1)
    script = ("from fedmvp.federated.prepare import prepare_run\nfrom fedmvp.federated.simulation import simulate\n"
              "from tests.federated.recording_client import app\n"
              f"simulate(prepare_run({str(preset)!r}, {str(run_dir)!r}, None, False, 'cpu'), progress=False, "
              f"cpus={cpus}, client_app=app, eval_every=2)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True, timeout=scaled(280), env={**os.environ, "FEDMVP_TEST_RECORD": str(record)})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    rows = [json.loads(p.read_text()) for p in sorted(record.glob("*.json"))]
    seed = json.loads((run_dir / "config.json").read_text())["seed"]
    asked = {r: sorted(x["partition"] for x in rows if x["kind"] == "train" and x["round"] == r) for r in (1, 2, 3)}
    assert asked == {r: sample_sites(seed, 0.34, 3, r) for r in (1, 2, 3)} and all(len(a) == 1 for a in asked.values())
    for r in (1, 2, 3):
        assert json.loads((run_dir / f"round-{r:04d}" / "state.json").read_text())["sites"] == asked[r]
    assert sorted(x["partition"] for x in rows if x["kind"] == "identify") == [0, 1, 2]  # once each
    evaluated = {r: sorted(x["partition"] for x in rows if x["kind"] == "evaluate" and x["round"] == r)
                 for r in (0, 2, 3)}
    assert evaluated == {0: [0, 1, 2], 2: [0, 1, 2], 3: [0, 1, 2]}  # zero-shot, every 2nd round and the last
    assert {x["threads"] for x in rows if x["kind"] == "train"} == {(os.cpu_count() or 1) // cpus}
