"""fedmvp-export --format executorch: the ExecuTorch program in the bundle, hashed and parity-checked."""

from __future__ import annotations

import importlib.util
import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from export_helpers import rebuilt_model

from edge_client.bundle import BundleError, read_bundle
from export import parity
from fedmvp_apps.export_cli import main
from fedmvp_formats.files import sha256_file
from fedmvp_formats.parity_rules import FP32_MAX_ABS_DIFF

HAVE_EXECUTORCH = importlib.util.find_spec("executorch") is not None
needs_executorch = pytest.mark.skipif(not HAVE_EXECUTORCH,
                                      reason="executorch is not installed (pip install 'fedmvp[executorch]')")


@pytest.fixture(scope="module")
def et_bundle(tiny_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("et-bundles") / "fp32-et"
    result = CliRunner().invoke(main, ["--run", str(tiny_run), "--out", str(out), "--format", "executorch",
                                       "--parity-images", "32", "--json"])
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


@needs_executorch
def test_the_bundle_lists_the_program_with_its_hash(et_bundle):
    out, report = et_bundle
    m = read_bundle(out).manifest  # every listed sha256 verified
    assert m["files_by_role"]["executorch"] == "model.pte"
    assert m["files"]["model.pte"]["sha256"] == sha256_file(out / "model.pte")
    section = m["executorch"]
    assert section["format"] == "executorch.pte" and section["backend"] == "xnnpack"
    assert section["outputs"] == ["logits", "probs", "image_embeds"] and section["method"] == "forward"
    assert section["inputs"] == ["pixel_values", *section["lora_inputs"]]
    assert sorted(section["lora_inputs"]) == sorted(m["lora"]["tensors"])
    assert section["promptformer_digest"] == m["promptformer"]["digest"]
    et = m["parity"]["executorch"]
    assert et["passed"] and et["top1_agreement"] == 1.0 and et["max_abs_logit_diff"] <= FP32_MAX_ABS_DIFF
    assert report["parity"]["executorch"]["passed"] and "model.pte" in report["sizes"]
    assert "torchscript" not in m  # one format asked for, one written


@needs_executorch
def test_the_program_gives_the_pytorch_models_logits_with_the_lora_fed(et_bundle, tiny_run):
    from edge_client.executorch_runtime import load_method, run_batches

    out, _ = et_bundle
    model, _ = rebuilt_model(tiny_run)
    images = torch.randn(11, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    reference = parity.torch_logits(model, images)
    bundle = read_bundle(out)
    section, lora = bundle.manifest["executorch"], bundle.lora()
    method = load_method(out / "model.pte")
    feed = [lora[n] for n in section["lora_inputs"]]
    assert section["batch"] == "dynamic" and section["max_batch"] == 8
    for batch in (1, 3, 8):  # traced at 2: any batch up to max_batch, and 11 images split into calls
        got = run_batches(method, images.numpy(), feed, batch)
        assert [o.shape[0] for o in got] == [11, 11, 11]
        assert np.max(np.abs(got[0] - reference)) <= FP32_MAX_ABS_DIFF
        assert (got[0].argmax(-1) == reference.argmax(-1)).all()
    zero = {n: np.zeros_like(t) if n.endswith("lora_B.weight") else t for n, t in lora.items()}
    other = run_batches(method, images.numpy(), [zero[n] for n in section["lora_inputs"]], 8)[0]
    assert np.max(np.abs(other - reference)) > FP32_MAX_ABS_DIFF  # the LoRA fed is the LoRA run


@needs_executorch
def test_a_tampered_program_is_refused_at_load(et_bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(et_bundle[0], copy)
    path = copy / "model.pte"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="model.pte: sha256 does not match"):
        read_bundle(copy)


@needs_executorch
def test_a_section_without_its_role_is_refused(et_bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(et_bundle[0], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["files_by_role"]["executorch"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="executorch"):
        read_bundle(copy)


def test_a_bundle_without_it_has_no_entry(tiny_bundle):
    m = read_bundle(tiny_bundle.path).manifest
    assert "executorch" not in m and "executorch" not in m["files_by_role"] and "executorch" not in m["parity"]


@pytest.mark.skipif(HAVE_EXECUTORCH, reason="executorch is installed here")
def test_without_executorch_the_format_is_refused_first_in_one_line(tiny_run, tmp_path):
    result = CliRunner().invoke(main, ["--run", str(tiny_run), "--out", str(tmp_path / "b"), "--format", "executorch"])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "pip install 'fedmvp[executorch]'" in result.stderr
    assert not (tmp_path / "b").exists()
