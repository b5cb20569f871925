"""`fedmvp-export --inference-only`: a bundle without what only on-device training needs."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from edge_client.bundle import read_bundle
from fedmvp_apps.edge_cli import main as edge_main
from edge_client.infer import Predictor
from fedmvp_apps.export_cli import main as export_main

EXPECTED_FILES = {
    "fp32": ["check_images.safetensors", "lora.safetensors", "manifest.json", "model.onnx",
             "weights.safetensors"],  # ONNX external data
    "fp16": ["check_images.safetensors", "lora.safetensors", "manifest.json", "model.onnx"],  # fp16 weights embedded
}


@pytest.mark.parametrize("precision", sorted(EXPECTED_FILES))
def test_inference_only_bundle_infers_and_refuses_training(precision, tiny_run, tiny_bundle, tmp_path):
    out = tmp_path / f"infer-{precision}"
    result = CliRunner().invoke(export_main, ["--run", str(tiny_run), "--precision", precision, "--out", str(out),
                                              "--inference-only", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert sorted(p.name for p in out.iterdir()) == EXPECTED_FILES[precision]
    assert sorted(report["sizes"]) == EXPECTED_FILES[precision]
    bundle = read_bundle(out)  # every listed file verified
    assert not bundle.trainable and bundle.manifest["training"] is None
    assert not bundle.refreshable and "inference only" in bundle.refresh_blocker()
    assert report["total_bytes"] < tiny_bundle.total_bytes

    reference = Predictor(read_bundle(tiny_bundle.path), provider="cpu")
    pixels = np.random.default_rng(0).normal(0, 1, (4, 3, 32, 32)).astype(np.float32)
    logits = Predictor(bundle, provider="cpu").run(pixels)["logits"]
    tolerance = 1e-5 if precision == "fp32" else 0.05
    np.testing.assert_allclose(logits, reference.run(pixels)["logits"], atol=tolerance)

    data = tmp_path / "local" / bundle.class_names[0]
    data.mkdir(parents=True)
    from PIL import Image

    Image.new("RGB", (32, 32), (200, 30, 30)).save(data / "a.png")
    trained = CliRunner().invoke(edge_main, ["train", "--data", str(data.parent), "--bundle", str(out),
                                             "--out", str(tmp_path / "updates")])
    assert trained.exit_code == 2 and "exported for inference only" in trained.stderr
    assert not (tmp_path / "updates").exists()
    info = CliRunner().invoke(edge_main, ["info", "--bundle", str(out)])
    assert info.exit_code == 0 and "training: no (inference-only bundle)" in info.stdout
