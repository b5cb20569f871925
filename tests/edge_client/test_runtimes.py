"""The device's runtimes: OpenVINO beside ONNX Runtime, and `auto` (docs/architecture.md, "Runtimes").

`auto` verifies each candidate on the bundle's check images against the bundle as exported, caches the
verdict per bundle and machine, and falls back with one line when nothing passes; a runtime named and
unavailable is an error (FEDMVP_DISABLED_RUNTIMES makes an installed one unavailable, as on a device
that must not use it).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from edge_client.bundle import Bundle
from fedmvp_apps.edge_bundle import DISABLED_ENV
from edge_client.infer import Predictor, infer_paths
from edge_client.runtime_choice import cache_path, check_images, choose
from fedmvp_apps.edge_cli import main


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Each test its own verdict cache ($FEDMVP_CACHE), never the user's."""
    monkeypatch.setenv("FEDMVP_CACHE", str(tmp_path / "cache"))


def test_openvino_gives_the_same_top1_as_onnx_runtime(edge_bundle, data_root):
    pytest.importorskip("openvino")
    files = sorted((data_root / "test").rglob("*.png"))
    ort = infer_paths(files, edge_bundle, top_k=3, provider="cpu", personalised=False)
    ov = infer_paths(files, edge_bundle, top_k=3, runtime="openvino", precision="fp32", personalised=False)
    assert ov.runtime == "openvino" and ov.precision == "fp32" and ov.provider == "OpenVINO CPU"
    assert [p.label for p in ov.predictions] == [p.label for p in ort.predictions] and len(ov.predictions) > 10
    np.testing.assert_allclose([p.prob for p in ov.predictions], [p.prob for p in ort.predictions], atol=1e-4)


def test_openvino_runs_a_fed_lora_as_onnx_runtime_does(edge_bundle):
    """The LoRA constants become Parameters: a round's LoRA is fed per run, one compiled model for all."""
    pytest.importorskip("openvino")
    from edge_client.lora_store import ActiveLora

    bundle = Bundle.open(edge_bundle)
    other = {k: (v + np.random.default_rng(2).normal(scale=0.5, size=v.shape)).astype(np.float32)
             for k, v in bundle.lora().items()}
    lora = ActiveLora(tensors=other, source="global", file=bundle.path)
    pixels = check_images(bundle, 4)
    warm = Predictor(edge_bundle, runtime="openvino", precision="fp32", personalised=False)
    own = warm.run(pixels)["logits"]
    warm.use_lora(lora)
    fed = warm.run(pixels)["logits"]
    onnx_runtime = Predictor(edge_bundle, provider="cpu", lora=lora).run(pixels)["logits"]
    assert np.allclose(fed, onnx_runtime, atol=1e-4) and not np.allclose(fed, own, atol=1e-3)
    built = Predictor(edge_bundle, runtime="openvino", precision="fp32", lora=lora).run(pixels)["logits"]
    np.testing.assert_allclose(built, fed, atol=1e-5)


def test_auto_caches_its_verdict_per_bundle_and_reuses_it(edge_bundle, tmp_path):
    pytest.importorskip("openvino")
    bundle = Bundle.open(edge_bundle)
    first = choose(bundle, "auto", "auto", "cpu")
    assert first.how in ("auto", "fallback") and not first.cached and first.cache is not None
    assert set(first.verdicts) >= {"ort:fp32", "openvino:fp32"} and first.verdicts["ort:fp32"]["passed"]
    record = json.loads(first.cache.read_text())
    assert record["bundle_id"] == bundle.id and len(record["reference"]) == 32
    # a second call verifies nothing: even expectations that every candidate would now fail are not re-run
    record["reference"] = [row[1:] + row[:1] for row in record["reference"]]
    first.cache.write_text(json.dumps(record))
    again = choose(bundle, "auto", "auto", "cpu")
    assert again.cached and again.candidate == first.candidate and "cached verdict" in again.line
    # another bundle (another manifest, so another id) has its own verdict
    other = tmp_path / "other"
    shutil.copytree(edge_bundle, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["source"]["run"] = "another-run"
    (other / "manifest.json").write_text(json.dumps(manifest))
    moved = Bundle.open(other)
    assert moved.id != bundle.id and cache_path(moved, "cpu", None) != first.cache
    assert not choose(moved, "auto", "auto", "cpu").cached


def test_auto_falls_back_with_a_line_when_the_check_images_disagree(edge_bundle, data_root):
    """Check expectations that no runtime meets (the classes rolled): the bundle as exported on ONNX Runtime
    runs, and the one line says that auto verified nothing."""
    pytest.importorskip("openvino")
    bundle = Bundle.open(edge_bundle)
    path = choose(bundle, "auto", "auto", "auto").cache
    record = json.loads(path.read_text())
    record["reference"] = [row[1:] + row[:1] for row in record["reference"]]
    record["verdicts"] = {}
    path.write_text(json.dumps(record))
    folder = data_root / "test" / "red_circle"
    out = CliRunner().invoke(main, ["infer", str(folder), "--bundle", str(edge_bundle), "--runtime", "auto",
                                    "--json", "--bundle-lora"])
    assert out.exit_code == 0, out.output
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert "the bundle as exported: auto verified no candidate" in out.stderr and "top-1 agreement" in out.stderr
    assert {line["runtime"] for line in lines} == {"ort"} and {line["precision"] for line in lines} == {"fp32"}
    verdicts = json.loads(path.read_text())["verdicts"]
    assert verdicts and not any(v["passed"] for v in verdicts.values())


def test_a_runtime_named_and_unavailable_is_an_error(edge_bundle, data_root, monkeypatch):
    monkeypatch.setenv(DISABLED_ENV, "openvino")
    image = str(sorted((data_root / "test" / "red_circle").glob("*.png"))[0])
    out = CliRunner().invoke(main, ["infer", image, "--bundle", str(edge_bundle), "--runtime", "openvino"])
    assert out.exit_code == 2 and out.stderr.strip() == \
        f"error: openvino is disabled on this device ({DISABLED_ENV}=openvino)"
    info = CliRunner().invoke(main, ["info", "--bundle", str(edge_bundle), "--runtime", "openvino", "--json"])
    assert info.exit_code == 2 and "disabled" in json.loads(info.stdout)["runtime"]["error"]
    # auto with only ONNX Runtime left runs it and says why
    out = CliRunner().invoke(main, ["infer", image, "--bundle", str(edge_bundle), "--runtime", "auto"])
    assert out.exit_code == 0 and "runtime: ort fp32 (the only one offered here: openvino is disabled" in out.stderr


@pytest.mark.parametrize("args, said", [
    (["--precision", "int8"], "int8 runs the bundle's int8 model: export one with fedmvp-export --precision int8"),
    (["--runtime", "ort", "--precision", "bf16"], "ort offers fp32 for this fp32 bundle on this machine, not bf16"),
])
def test_a_precision_not_offered_is_an_error(edge_bundle, data_root, args, said):
    image = str(sorted((data_root / "test" / "red_circle").glob("*.png"))[0])
    out = CliRunner().invoke(main, ["infer", image, "--bundle", str(edge_bundle), *args])
    assert out.exit_code == 2 and said in out.stderr


def test_the_precision_hint_reaches_openvino(edge_bundle):
    """bf16 is what the CPU plugin compiles where it lists BF16: its logits differ from fp32's."""
    pytest.importorskip("openvino")
    from edge_client.engines import offered

    bundle = Bundle.open(edge_bundle)
    if "bf16" not in offered("openvino", bundle):
        pytest.skip("this CPU offers no bf16")
    pixels = check_images(bundle, 8)
    fp32 = Predictor(bundle, runtime="openvino", precision="fp32").run(pixels)["logits"]
    bf16 = Predictor(bundle, runtime="openvino", precision="bf16")
    assert bf16.engine.precision == "bf16" and not np.allclose(bf16.run(pixels)["logits"], fp32, atol=1e-4)


def test_the_library_reads_no_environment_the_device_command_does(edge_bundle, data_root, monkeypatch):
    """``$FEDMVP_DISABLED_RUNTIMES`` is the app's to read (fedmvp_apps/edge_bundle.py); edge_client is told."""
    from edge_client.engines import disable_runtimes, unavailable

    monkeypatch.setenv(DISABLED_ENV, "openvino")
    assert unavailable("openvino") is None or "disabled" not in unavailable("openvino")
    disable_runtimes("OpenVINO, ort", "told by the test")
    assert unavailable("ort") == "ort is disabled on this device (told by the test)"
    image = str(sorted((data_root / "test" / "red_circle").glob("*.png"))[0])
    out = CliRunner().invoke(main, ["infer", image, "--bundle", str(edge_bundle), "--runtime", "ort"])
    assert out.exit_code == 0, out.output  # the command replaced the test's switch with the environment's
    assert unavailable("openvino") == f"openvino is disabled on this device ({DISABLED_ENV}=openvino)"
