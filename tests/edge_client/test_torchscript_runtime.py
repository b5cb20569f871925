"""`edge-client --runtime torchscript`: the bundle's TorchScript module, named, under auto, and where absent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from edge_helpers import REPO

from edge_client.bundle import read_bundle
from edge_client.engines import candidates
from edge_client.infer import Predictor
from edge_client.lora_store import ActiveLora
from edge_client.runtime_choice import check_images
from fedmvp_apps.edge_bundle import DISABLED_ENV
from fedmvp_apps.edge_cli import main
from tests.deadlines import scaled


@pytest.fixture(scope="module")
def ts_bundle(edge_run, tmp_path_factory):
    """fp32 bundle of round 2 with model.torchscript.pt. Read-only."""
    from export.bundle_writer import BundleOptions, ExportOptions, export_bundle

    out = tmp_path_factory.mktemp("ts-bundles") / "fp32-ts"
    return export_bundle(edge_run, 2, out, ExportOptions(BundleOptions(torchscript=True), parity_images=32)).path


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Each test its own verdict cache ($FEDMVP_CACHE), never the user's."""
    monkeypatch.setenv("FEDMVP_CACHE", str(tmp_path / "cache"))


def _infer(bundle, data_root, *args: str):
    folder = data_root / "test" / "red_circle"
    out = CliRunner().invoke(main, ["infer", str(folder), "--bundle", str(bundle), "--json", *args])
    return out, [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_torchscript_gives_ort_top1_on_the_check_images(ts_bundle):
    bundle = read_bundle(ts_bundle)
    pixels = check_images(bundle)
    ort = Predictor(bundle, personalised=False, runtime="ort").run(pixels)["logits"]
    ts = Predictor(bundle, personalised=False, runtime="torchscript").run(pixels)["logits"]
    assert ts.shape == ort.shape and len(ts) >= 8
    assert (ts.argmax(-1) == ort.argmax(-1)).all() and np.max(np.abs(ts - ort)) <= 1e-3


def test_infer_by_name_matches_ort(ts_bundle, data_root):
    out, lines = _infer(ts_bundle, data_root, "--runtime", "torchscript", "--bundle-lora")
    assert out.exit_code == 0, out.output
    assert "runtime: torchscript fp32" in out.stderr and {line["runtime"] for line in lines} == {"torchscript"}
    assert "only one offered" not in out.stderr  # named: ONNX Runtime is offered too, the line must not say otherwise
    _, ort = _infer(ts_bundle, data_root, "--runtime", "ort", "--bundle-lora")
    assert [line["top_k"][0]["class"] for line in lines] == [line["top_k"][0]["class"] for line in ort]
    assert len(lines) == len(ort) > 0


def test_a_personalised_lora_is_fed_not_stale(ts_bundle):
    bundle = read_bundle(ts_bundle)
    rng = np.random.default_rng(0)
    lora = {k: (v + rng.normal(0, 0.5, v.shape)).astype(np.float32) for k, v in bundle.lora().items()}
    given = ActiveLora(lora, "global", bundle.file("lora"))
    pixels = check_images(bundle)
    ort = Predictor(bundle, runtime="ort", lora=given).run(pixels)["logits"]
    ts_predictor = Predictor(bundle, runtime="torchscript", lora=given)
    ts = ts_predictor.run(pixels)["logits"]
    assert np.max(np.abs(ts - ort)) <= 1e-3
    stored = Predictor(bundle, personalised=False, runtime="torchscript").run(pixels)["logits"]
    assert np.max(np.abs(stored - ts)) > 1e-3  # the LoRA given is the one run
    ts_predictor.use_lora(ActiveLora(bundle.lora(), "bundle", bundle.file("lora")))  # swapped per run
    assert np.max(np.abs(ts_predictor.run(pixels)["logits"] - stored)) <= 1e-5


def test_a_bundle_without_the_module_refuses_it_in_one_line(edge_bundle, data_root):
    image = str(sorted((data_root / "test" / "red_circle").glob("*.png"))[0])
    out = CliRunner().invoke(main, ["infer", image, "--bundle", str(edge_bundle), "--runtime", "torchscript"])
    assert out.exit_code == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "carries no TorchScript module" in out.stderr
    assert "--format torchscript" in out.stderr
    _, lines = _infer(edge_bundle, data_root, "--runtime", "torchscript")
    assert [line["ok"] for line in lines] == [False]
    assert candidates(read_bundle(edge_bundle), "auto", "auto")[0]  # auto simply leaves it out


def test_auto_weighs_it_and_takes_ort_or_better(ts_bundle, data_root, monkeypatch):
    monkeypatch.setenv(DISABLED_ENV, "openvino")
    out, lines = _infer(ts_bundle, data_root, "--runtime", "auto", "--bundle-lora")
    assert out.exit_code == 0, out.output
    assert "picked by auto" in out.stderr
    info = CliRunner().invoke(main, ["info", "--bundle", str(ts_bundle), "--runtime", "auto", "--json"])
    report = json.loads(info.stdout)
    verdicts = report["runtime"]["verdicts"]
    assert set(verdicts) == {"ort:fp32", "torchscript:fp32"} and verdicts["torchscript:fp32"]["passed"]
    assert report["runtime"]["cached"]  # the second call reads the verdict
    picked = report["runtime"]["runtime"]
    assert {line["runtime"] for line in lines} == {picked}
    assert verdicts[f"{picked}:fp32"]["ms_per_image"] <= verdicts["ort:fp32"]["ms_per_image"]
    assert report["device"]["runtimes"]["torchscript"]["available"] is True
    assert report["device"]["runtimes"]["torchscript"]["version"]
    assert report["runtime"]["offered"]["torchscript"] == ["fp32"]


def test_info_lists_it_unavailable_where_disabled_or_absent(edge_bundle, monkeypatch):
    monkeypatch.setenv(DISABLED_ENV, "torchscript")
    report = json.loads(CliRunner().invoke(main, ["info", "--bundle", str(edge_bundle), "--json"]).stdout)
    assert report["device"]["runtimes"]["torchscript"]["available"] is False


@pytest.mark.processes
def test_the_default_runtime_stays_torch_free_on_a_torchscript_bundle(ts_bundle, data_root, tmp_path):
    from test_torch_free import SCRIPT

    commands = {"infer": ["infer", str(data_root / "test" / "red_circle"), "--bundle", str(ts_bundle), "--json"],
                "auto": ["infer", str(data_root / "test" / "red_circle"), "--bundle", str(ts_bundle), "--json",
                         "--runtime", "auto"],
                "info": ["info", "--bundle", str(ts_bundle), "--json"],
                "named": ["infer", str(data_root / "test" / "red_circle"), "--bundle", str(ts_bundle),
                          "--runtime", "torchscript"]}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "FEDMVP_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(commands)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=scaled(300))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.rsplit("RESULT ", 1)[1])
    assert result["leaked"] == []
    assert result["codes"] == {"infer": 0, "auto": 0, "info": 0, "named": 2}, proc.stderr
    info = next(json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"bundle"'))
    assert info["device"]["runtimes"]["torchscript"]["available"] is False


def test_a_refreshed_bundle_does_not_offer_its_stale_module(ts_bundle):
    from dataclasses import replace

    from edge_client.engines import RuntimeUnavailable, offered

    bundle = read_bundle(ts_bundle)
    assert offered("torchscript", bundle) == ["fp32"]
    manifest = json.loads(json.dumps(bundle.manifest))
    manifest["promptformer"]["digest"] = "0" * 64  # what a refresh to another round records
    moved = replace(bundle, manifest=manifest)
    assert offered("torchscript", moved) == []
    with pytest.raises(RuntimeUnavailable, match="holds another PromptFormer than the refreshed bundle"):
        candidates(moved, "torchscript", "auto")


def test_a_real_refresh_leaves_the_module_unoffered(moved_run, data_root, tmp_path):
    from safetensors.numpy import load_file

    from edge_client.engines import offered
    from edge_client.refresh import promptformer_digest, refresh_bundle
    from export.bundle_writer import BundleOptions, ExportOptions, export_bundle

    out = export_bundle(moved_run, 1, tmp_path / "bundle", ExportOptions(BundleOptions(torchscript=True),
                                                                          parity_images=32)).path
    assert offered("torchscript", read_bundle(out)) == ["fp32"]
    round2 = load_file(str(moved_run / "round-0002" / "global.safetensors"))
    refresh_bundle(read_bundle(out), round2, digest=promptformer_digest(round2), round_number=2)
    refreshed = read_bundle(out)  # every hash still holds: the module is unchanged, and stale
    assert offered("torchscript", refreshed) == [] and offered("ort", refreshed) == ["fp32"]
    image = str(sorted((data_root / "test" / "red_circle").glob("*.png"))[0])
    result = CliRunner().invoke(main, ["infer", image, "--bundle", str(out), "--runtime", "torchscript"])
    assert result.exit_code == 2 and "re-export the round with --format torchscript" in result.stderr
