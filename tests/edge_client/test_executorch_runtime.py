"""`edge-client --runtime executorch`: the bundle's ExecuTorch program, named, under auto, and where absent."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner
from edge_helpers import REPO
from test_torchscript_runtime import _infer, _own_cache  # noqa: F401  (_own_cache: autouse, each test its own cache)

from edge_client.bundle import read_bundle
from edge_client.engines import RuntimeUnavailable, candidates, offered
from edge_client.infer import Predictor
from edge_client.lora_store import ActiveLora
from edge_client.runtime_choice import check_images
from fedmvp_apps.edge_bundle import DISABLED_ENV
from fedmvp_apps.edge_cli import main
from tests.deadlines import scaled

HAVE_EXECUTORCH = importlib.util.find_spec("executorch") is not None
needs_executorch = pytest.mark.skipif(not HAVE_EXECUTORCH,
                                      reason="executorch is not installed (pip install 'fedmvp[executorch]')")


@pytest.fixture(scope="module")
def et_bundle(edge_run, tmp_path_factory):
    """fp32 bundle of round 2 with model.pte. Read-only."""
    from export.bundle_writer import BundleOptions, ExportOptions, export_bundle

    out = tmp_path_factory.mktemp("et-bundles") / "fp32-et"
    return export_bundle(edge_run, 2, out, ExportOptions(BundleOptions(executorch=True), parity_images=32)).path


@needs_executorch
def test_executorch_gives_ort_top1_on_the_check_images(et_bundle):
    bundle = read_bundle(et_bundle)
    pixels = check_images(bundle)
    ort = Predictor(bundle, personalised=False, runtime="ort").run(pixels)["logits"]
    et = Predictor(bundle, personalised=False, runtime="executorch").run(pixels)["logits"]
    assert et.shape == ort.shape and len(et) >= 8
    assert (et.argmax(-1) == ort.argmax(-1)).all() and np.max(np.abs(et - ort)) <= 1e-3


@needs_executorch
def test_infer_by_name_matches_ort(et_bundle, data_root):
    out, lines = _infer(et_bundle, data_root, "--runtime", "executorch", "--bundle-lora")
    assert out.exit_code == 0, out.output
    assert "runtime: executorch fp32" in out.stderr and {line["runtime"] for line in lines} == {"executorch"}
    _, ort = _infer(et_bundle, data_root, "--runtime", "ort", "--bundle-lora")
    assert [line["top_k"][0]["class"] for line in lines] == [line["top_k"][0]["class"] for line in ort]
    assert len(lines) == len(ort) > 0


@needs_executorch
def test_a_personalised_lora_is_fed_not_stale(et_bundle):
    bundle = read_bundle(et_bundle)
    rng = np.random.default_rng(0)
    lora = {k: (v + rng.normal(0, 0.5, v.shape)).astype(np.float32) for k, v in bundle.lora().items()}
    given = ActiveLora(lora, "global", bundle.file("lora"))
    pixels = check_images(bundle)
    ort = Predictor(bundle, runtime="ort", lora=given).run(pixels)["logits"]
    et_predictor = Predictor(bundle, runtime="executorch", lora=given)
    et = et_predictor.run(pixels)["logits"]
    assert np.max(np.abs(et - ort)) <= 1e-3
    stored = Predictor(bundle, personalised=False, runtime="executorch").run(pixels)["logits"]
    assert np.max(np.abs(stored - et)) > 1e-3  # the LoRA given is the one run
    et_predictor.use_lora(ActiveLora(bundle.lora(), "bundle", bundle.file("lora")))  # swapped per run
    assert np.max(np.abs(et_predictor.run(pixels)["logits"] - stored)) <= 1e-5


def test_a_bundle_without_the_program_refuses_it_in_one_line(edge_bundle, data_root, monkeypatch):
    monkeypatch.setenv(DISABLED_ENV, "")
    image = str(sorted((data_root / "test" / "red_circle").glob("*.png"))[0])
    out = CliRunner().invoke(main, ["infer", image, "--bundle", str(edge_bundle), "--runtime", "executorch"])
    assert out.exit_code == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1
    if HAVE_EXECUTORCH:
        assert "carries no ExecuTorch program" in out.stderr and "--format executorch" in out.stderr
    else:
        assert "executorch is not installed" in out.stderr and "fedmvp[executorch]" in out.stderr
    assert candidates(read_bundle(edge_bundle), "auto", "auto")[0]  # auto simply leaves it out


@needs_executorch
def test_auto_weighs_it_and_takes_ort_or_better(et_bundle, data_root, monkeypatch):
    monkeypatch.setenv(DISABLED_ENV, "openvino,torchscript")
    out, lines = _infer(et_bundle, data_root, "--runtime", "auto", "--bundle-lora")
    assert out.exit_code == 0, out.output
    assert "picked by auto" in out.stderr
    info = CliRunner().invoke(main, ["info", "--bundle", str(et_bundle), "--runtime", "auto", "--json"])
    report = json.loads(info.stdout)
    verdicts = report["runtime"]["verdicts"]
    assert set(verdicts) == {"ort:fp32", "executorch:fp32"} and verdicts["executorch:fp32"]["passed"]
    picked = report["runtime"]["runtime"]
    assert {line["runtime"] for line in lines} == {picked}
    assert verdicts[f"{picked}:fp32"]["ms_per_image"] <= verdicts["ort:fp32"]["ms_per_image"]
    assert report["device"]["runtimes"]["executorch"]["available"] is True
    assert report["device"]["runtimes"]["executorch"]["version"]
    assert report["runtime"]["offered"]["executorch"] == ["fp32"]


@needs_executorch
def test_a_refreshed_bundle_does_not_offer_its_stale_program(et_bundle):
    bundle = read_bundle(et_bundle)
    assert offered("executorch", bundle) == ["fp32"]
    manifest = json.loads(json.dumps(bundle.manifest))
    manifest["promptformer"]["digest"] = "0" * 64  # what a refresh to another round records
    moved = replace(bundle, manifest=manifest)
    assert offered("executorch", moved) == []
    with pytest.raises(RuntimeUnavailable, match="ExecuTorch program holds another PromptFormer"):
        candidates(moved, "executorch", "auto")


@needs_executorch
@pytest.mark.processes
def test_the_default_runtime_stays_torch_free_on_an_executorch_bundle(et_bundle, data_root, tmp_path):
    from test_torch_free import SCRIPT

    folder = str(data_root / "test" / "red_circle")
    commands = {"infer": ["infer", folder, "--bundle", str(et_bundle), "--json"],
                "auto": ["infer", folder, "--bundle", str(et_bundle), "--json", "--runtime", "auto"],
                "named": ["infer", folder, "--bundle", str(et_bundle), "--runtime", "executorch"]}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "FEDMVP_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(commands)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=scaled(300))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.rsplit("RESULT ", 1)[1])
    assert result["leaked"] == []
    assert result["codes"] == {"infer": 0, "auto": 0, "named": 2}, proc.stderr
