"""The TorchScript training module (train.torchscript.pt): exported with --format torchscript beside train.pt2,
the same outputs and LoRA gradients, trained through by `edge-client train --program torchscript` and, where
train.pt2 does not load, automatically; its update is ingested by the server; a hostile module is refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from edge_helpers import REPO, write_local_data

from edge_client import program as program_module
from edge_client.bundle import Bundle, BundleError, read_bundle
from edge_client.program import load_program, load_runner
from edge_client.safetensors_check import load_safetensors
from edge_client.torchscript_check import check_archive, check_module
from edge_client.torchscript_training import load_script_runner
from fedmvp_formats.objective import fedmvp_objective
from tests.deadlines import scaled
from tests.edge_client.test_torchscript_attacks import ReadsAFile, TwoMethods, _saved
from tests.hostile.forge import resign

MODULE = "train.torchscript.pt"


@pytest.fixture(scope="module")
def ts_train(edge_run, tmp_path_factory):
    """Trainable fp32 bundle of round 2 with both TorchScript modules. Read-only."""
    from export.bundle_writer import BundleOptions, ExportOptions, export_bundle

    out = tmp_path_factory.mktemp("ts-train") / "fp32-ts"
    return export_bundle(edge_run, 2, out, ExportOptions(BundleOptions(torchscript=True), parity_images=32)).path


@pytest.fixture(autouse=True)
def _fresh_caches():
    """Each test loads the programs itself (the loaders cache one per process)."""
    program_module._PROGRAMS.clear()
    from edge_client import torchscript_training

    torchscript_training._RUNNERS.clear()


def _inputs(bundle: Bundle, batch: int = 4):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, generator=gen)
    weights = dict(sorted(load_safetensors(bundle.file("weights"), framework="pt").items()))
    lora = {k: torch.from_numpy(np.array(v)) for k, v in sorted(bundle.lora().items())}
    return x, x.flip(-1), lora, weights


def _outputs_and_grads(runner, x, view, lora, weights):
    leaves = {k: v.clone().requires_grad_(True) for k, v in lora.items()}
    features, logits, frozen = runner(x, view, leaves, weights)
    loss = fedmvp_objective(features, logits, frozen, torch.arange(len(x)) % logits.shape[1], 1.0, F)["loss"]
    loss.backward()
    assert all(w.grad is None for w in weights.values())  # only what the caller marks trains
    return [t.detach() for t in (features, logits, frozen)], {k: v.grad for k, v in leaves.items()}


def test_export_writes_the_module_with_its_section_and_parity(ts_train):
    m = read_bundle(ts_train).manifest  # hashes verified, the section checked against the role
    section = m["torchscript_training"]
    assert m["files_by_role"]["torchscript_training"] == MODULE and MODULE in m["files"]
    assert section["outputs"] == ["prompted_features", "logits", "frozen_features"]
    assert section["inputs"] == ["pixel_values", "consistency_view", *section["lora_inputs"], *section["weight_inputs"]]
    assert section["lora_inputs"] == sorted(m["lora"]["tensors"]) and section["trainable"] == "lora"
    assert section["weight_inputs"] == sorted(load_safetensors(ts_train / "weights.safetensors", framework="pt"))
    assert section["parity"]["passed"] and section["parity"]["max_abs_output_diff"] <= 1e-3
    assert (ts_train / MODULE).stat().st_size < (ts_train / "weights.safetensors").stat().st_size / 10  # no weights


def test_forward_and_lora_gradients_equal_train_pt2s(ts_train):
    bundle = read_bundle(ts_train)
    x, view, lora, weights = _inputs(bundle)
    want, want_grads = _outputs_and_grads(load_program(bundle), x, view, lora, weights)
    runner = load_script_runner(bundle)
    got, got_grads = _outputs_and_grads(runner, x, view, lora, weights)
    for a, b in zip(got, want):
        assert a.shape == b.shape and float((a - b).abs().max()) <= 1e-4
    for name, grad in want_grads.items():
        assert float(grad.abs().max()) > 0  # the loss reaches every LoRA tensor
        assert float((got_grads[name] - grad).abs().max()) <= 1e-4 * float(grad.abs().max()) + 1e-7
    assert runner.max_segments() == 1 and len(runner.plan(4)) == 1  # no checkpointing through TorchScript


def test_a_plain_jit_load_runs_forward_and_backward(ts_train):
    section = read_bundle(ts_train).manifest["torchscript_training"]
    _, _, lora, weights = _inputs(read_bundle(ts_train))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = torch.jit.load(str(ts_train / MODULE))
    a = lora[section["lora_inputs"][0]].clone().requires_grad_(True)
    feed = [a, *(lora[n] for n in section["lora_inputs"][1:]), *(weights[n] for n in section["weight_inputs"])]
    x = torch.randn(3, 3, 32, 32)  # another batch than the traced one
    features, logits, frozen = module(x, x, *feed)
    logits.sum().backward()
    assert logits.shape[0] == 3 and a.grad is not None and a.grad.shape == a.shape


def test_auto_falls_back_where_train_pt2_does_not_load(ts_train, edge_bundle, monkeypatch):
    def refuse(*_a, **_k):
        raise RuntimeError("serialized archive version 99 is newer than this torch")

    monkeypatch.setattr(torch.export, "load", refuse)
    runner, name, note = load_runner(read_bundle(ts_train), "auto")
    assert name == "torchscript" and runner.program == "torchscript"
    assert note == (f"train.pt2 does not load with torch {torch.__version__} (serialized archive version 99 is "
                    f"newer than this torch); training through train.torchscript.pt")
    program_module._PROGRAMS.clear()
    with pytest.raises(BundleError, match="cannot load the training program"):
        load_runner(read_bundle(ts_train), "pt2")  # asked for by name: no fallback
    with pytest.raises(BundleError, match="cannot load the training program"):
        load_runner(read_bundle(edge_bundle), "auto")  # no TorchScript module to fall back to


def test_train_falls_back_in_process_and_says_so(ts_train, data_root, tmp_path, monkeypatch, capsys):
    from edge_client.train import train_local

    bundle = tmp_path / "bundle"
    shutil.copytree(ts_train, bundle)
    monkeypatch.setattr(torch.export, "load", lambda *_a, **_k: (_ for _ in ()).throw(RuntimeError("too new")))
    data = write_local_data(tmp_path / "local", Bundle.open(bundle).class_names[:2], per_class=2)
    result = train_local(data, bundle, epochs=1, batch_size=4, threads=1, out=tmp_path / "updates", apply=False)
    assert result.program == "torchscript" and result.to_json()["program"] == "torchscript"
    assert result.update_path.is_file() and "training through train.torchscript.pt" in capsys.readouterr().err


def _cli(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", f"from {module} import main; main()", *map(str, args)],
                          capture_output=True, text=True, timeout=scaled(300), env=env, cwd=REPO)


@pytest.mark.processes
def test_an_update_trained_through_the_torchscript_module_is_ingested_by_the_server(ts_train, edge_run, tmp_path):
    from fedmvp.runs import RunDir

    bundle = tmp_path / "bundle"
    shutil.copytree(ts_train, bundle)
    run = tmp_path / "run"
    shutil.copytree(edge_run, run)
    config = RunDir(run).read_config()
    RunDir(run).write_config({k: v for k, v in config.items() if k != "run_id"}
                             | ({"run_id": read_bundle(bundle).run_id} if read_bundle(bundle).run_id else {}))
    data = write_local_data(tmp_path / "local", Bundle.open(bundle).class_names[:2], per_class=3)
    done = _cli("fedmvp_apps.edge_cli", "train", "--data", data, "--bundle", bundle, "--epochs", "1",
                "--batch-size", "6", "--lr", "0.5", "--threads", "1", "--out", tmp_path / "updates",
                "--program", "torchscript", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["program"] == "torchscript" and report["checkpoint_segments"] == 1 and report["update"]
    ingested = _cli("fedmvp_apps.cli", "ingest", "--run", run, "--json", report["update"])
    assert ingested.returncode == 0, ingested.stdout + ingested.stderr
    result = json.loads(ingested.stdout)
    assert result["round"] == 3 and [r["file"] for r in result["accepted"]] == [report["update"]]


@pytest.mark.processes
def test_program_torchscript_on_a_bundle_without_it_is_one_line(edge_bundle, data_root, tmp_path):
    data = write_local_data(tmp_path / "local", Bundle.open(edge_bundle).class_names[:2], per_class=2)
    done = _cli("fedmvp_apps.edge_cli", "train", "--data", data, "--bundle", edge_bundle, "--out",
                tmp_path / "updates", "--program", "torchscript", "--no-apply")
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and "no TorchScript training module" in lines[0], done.stderr


def test_the_bundles_own_training_module_passes_both_checks(ts_train):
    path = ts_train / MODULE
    check_archive(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_module(path, torch.jit.load(str(path)), "training")


@pytest.mark.parametrize("module, says", [(ReadsAFile(), "aten::from_file"), (TwoMethods(), "not only forward")],
                         ids=["forbidden-op", "extra-method"])
def test_a_hostile_training_module_is_refused_in_one_line(ts_train, data_root, tmp_path, module, says):
    from click.testing import CliRunner

    from fedmvp_apps.edge_cli import main

    bundle = tmp_path / "bundle"
    shutil.copytree(ts_train, bundle)
    (bundle / MODULE).chmod(0o644)
    _saved(module, bundle / MODULE)
    resign(bundle, MODULE)
    read_bundle(bundle)  # the manifest agrees with the file: the hash check cannot catch it
    data = write_local_data(tmp_path / "local", Bundle.open(bundle).class_names[:2], per_class=2)
    out = CliRunner().invoke(main, ["train", "--data", str(data), "--bundle", str(bundle), "--out",
                                    str(tmp_path / "updates"), "--program", "torchscript", "--no-apply"])
    assert out.exit_code == 2, out.output
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "refusing to run it" in lines[0] and MODULE in lines[0]
    assert not (tmp_path / "updates").exists() or not any((tmp_path / "updates").iterdir())
