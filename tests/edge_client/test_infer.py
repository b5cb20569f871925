"""edge_client.infer and `edge-client infer`: ONNX Runtime on synthetic and awkward files, tampering."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from edge_helpers import CLASSES, preprocess_batch, write_awkward_files
from PIL import Image

from edge_client.bundle import Bundle, BundleError
from fedmvp_apps.edge_cli import main
from edge_client.infer import Predictor, infer_paths


def test_infer_synthetic_images_matches_the_session(edge_bundle, data_root):
    result = infer_paths([data_root / "test"], edge_bundle, top_k=3, batch_size=5, provider="cpu")
    assert result.ok and len(result.predictions) == 6 * 8 and result.provider == "CPUExecutionProvider"
    assert result.round == 2 and result.lora["source"] == "bundle"
    for pred in result.predictions:
        probs = [p for _, p in pred.top_k]
        assert len(pred.top_k) == 3 and probs == sorted(probs, reverse=True) and sum(probs) <= 1 + 1e-6
        assert {c for c, _ in pred.top_k} <= set(CLASSES) and pred.latency_ms >= pred.model_ms > 0
    # Same numbers as feeding the preprocessed batch to the session directly.
    predictor = Predictor(edge_bundle, provider="cpu")
    paths = [p.path for p in result.predictions[:7]]
    probs = predictor.run(preprocess_batch([Image.open(p).convert("RGB") for p in paths], predictor.spec))["probs"]
    for row, pred in zip(probs, result.predictions[:7]):
        best = int(np.argmax(row))
        assert pred.label == predictor.classes[best] and abs(pred.prob - row[best]) < 1e-6
    assert 0.0 <= result.accuracy() <= 1.0


def test_a_lora_fed_to_a_warm_session_equals_a_session_built_with_it(edge_bundle, data_root):
    """`Predictor.use_lora` (a federation node's every round, one session kept) gives the logits a new
    session with that LoRA as initializers gives; switching back gives the bundle's own again."""
    from edge_client.lora_store import ActiveLora

    bundle = Bundle.open(edge_bundle)
    rng = np.random.default_rng(1)
    other = {k: (v + rng.normal(scale=0.5, size=v.shape)).astype(np.float32) for k, v in bundle.lora().items()}
    lora = ActiveLora(tensors=other, source="global", file=bundle.path)
    files = sorted((data_root / "test" / "red_circle").glob("*.png"))[:4]
    warm = Predictor(edge_bundle, provider="cpu", personalised=False)
    pixels = preprocess_batch([Image.open(p).convert("RGB") for p in files], warm.spec)
    own = warm.run(pixels)["logits"]
    engine = warm.engine
    warm.use_lora(lora)
    fed = warm.run(pixels)["logits"]
    built = Predictor(edge_bundle, provider="cpu", lora=lora).run(pixels)["logits"]
    assert warm.engine is engine and np.allclose(fed, built, atol=1e-5) and not np.allclose(fed, own, atol=1e-3)
    warm.use_lora(ActiveLora(tensors=bundle.lora(), source="bundle", file=bundle.path))
    assert np.allclose(warm.run(pixels)["logits"], own, atol=1e-6)
    with pytest.raises(BundleError, match="shape|missing|LoRA"):
        warm.use_lora(ActiveLora(tensors={k: v[:1] for k, v in other.items()}, source="global", file=bundle.path))


def test_batch_size_does_not_change_results(edge_bundle, data_root):
    files = sorted((data_root / "test" / "red_circle").glob("*.png"))[:5]
    one = infer_paths(files, edge_bundle, batch_size=1, top_k=6, provider="cpu").predictions
    many = infer_paths(files, edge_bundle, batch_size=4, top_k=6, provider="cpu").predictions
    for a, b in zip(one, many):
        assert a.path == b.path and [c for c, _ in a.top_k] == [c for c, _ in b.top_k]
        np.testing.assert_allclose([p for _, p in a.top_k], [p for _, p in b.top_k], atol=1e-5)


def test_awkward_files(edge_bundle, tmp_path):
    good, bad = write_awkward_files(tmp_path / "awkward")
    result = infer_paths([tmp_path / "awkward"], edge_bundle, batch_size=4, provider="cpu")
    assert sorted(p.path.name for p in result.predictions) == sorted(good)
    assert sorted(e.path.name for e in result.errors) == sorted(bad)
    for err in result.errors:
        assert "\n" not in err.error and err.path.name in err.error
    reasons = {e.path.name: e.error for e in result.errors}
    assert "empty" in reasons["empty.png"]
    assert "not an image" in reasons["not_an_image.jpg"]
    assert "too many pixels" in reasons["huge_header.png"]
    assert "truncated" in reasons["truncated.png"]
    by_name = {p.path.name: p for p in result.predictions}
    # EXIF orientation applied: the rotated file is classified exactly like the upright one.
    assert by_name["exif_rotated.png"].top_k == by_name["upright.png"].top_k


def test_cli_awkward_files_exit_code_and_json_lines(edge_bundle, tmp_path):
    good, bad = write_awkward_files(tmp_path / "awkward")
    out = CliRunner().invoke(main, ["infer", str(tmp_path / "awkward"), "--bundle", str(edge_bundle), "--json",
                                    "--top-k", "2", "--provider", "cpu"])
    assert out.exit_code == 1, out.output
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    ok = [r for r in lines if "top_k" in r]
    failed = [r for r in lines if "error" in r]
    assert len(ok) == len(good) and len(failed) == len(bad)
    assert all(len(r["top_k"]) == 2 and r["latency_ms"] > 0 and r["provider"] == "CPUExecutionProvider"
               and {"class", "prob"} == set(r["top_k"][0]) for r in ok)


def test_cli_table_and_all_good_exit_zero(edge_bundle, data_root):
    folder = data_root / "test" / "blue_square"
    out = CliRunner().invoke(main, ["infer", str(folder / "000.png"), str(folder / "00[12].png"),
                                    "--bundle", str(edge_bundle), "--top-k", "3"])
    assert out.exit_code == 0, out.output
    rows = out.stdout.splitlines()
    assert rows[0].split() == ["PATH", "CLASS", "PROB", "LATENCY"] and len(rows) == 1 + 3 * 3
    assert "provider: CPUExecutionProvider" in out.stderr and "3 classified, 0 failed" in out.stderr


def test_missing_inputs_are_per_file_errors(edge_bundle, data_root, tmp_path):
    good = data_root / "test" / "blue_square" / "000.png"
    out = CliRunner().invoke(main, ["infer", str(good), str(tmp_path / "nope.jpg"), str(tmp_path / "*.png"),
                                    "--bundle", str(edge_bundle)])
    assert out.exit_code == 1
    assert out.stderr.count("error: ") == 2 and "1 classified, 2 failed" in out.stderr


def test_bundle_resolution_order(edge_bundle, tmp_path, monkeypatch):
    """The library resolves only what it is given (else ./bundle); $FEDMVP_BUNDLE is the command's to read."""
    from fedmvp_apps.edge_bundle import bundle_dir

    monkeypatch.delenv("FEDMVP_BUNDLE", raising=False)
    monkeypatch.chdir(tmp_path)
    assert Bundle.resolve_dir(None) == Bundle.resolve_dir("") and str(Bundle.resolve_dir(None)) == "bundle"
    assert Bundle.resolve_dir(bundle_dir(None)) == Path("bundle")
    monkeypatch.setenv("FEDMVP_BUNDLE", str(edge_bundle))
    assert str(Bundle.resolve_dir(None)) == "bundle"  # the library never reads the environment
    assert Bundle.resolve_dir(bundle_dir(None)) == edge_bundle and bundle_dir(Path("x")) == Path("x")
    monkeypatch.setenv("FEDMVP_BUNDLE", str(tmp_path / "gone"))
    with pytest.raises(BundleError, match=r"no bundle found; looked at \$FEDMVP_BUNDLE=.*gone\)"):
        Bundle.open(bundle_dir(None))
    monkeypatch.setenv("FEDMVP_BUNDLE", str(edge_bundle))
    image = tmp_path / "a.png"
    Image.new("RGB", (20, 20), (10, 20, 30)).save(image)
    assert CliRunner().invoke(main, ["infer", str(image)]).exit_code == 0  # from $FEDMVP_BUNDLE
    monkeypatch.delenv("FEDMVP_BUNDLE")
    out = CliRunner().invoke(main, ["infer", str(image)])  # ./bundle does not exist here
    assert out.exit_code == 2 and "not a bundle directory" in out.stderr


@pytest.mark.parametrize("victim", ["model.onnx", "weights.safetensors", "lora.safetensors", "manifest.json"])
def test_tampered_bundle_is_refused(bundle_dir, data_root, victim):
    path = bundle_dir / victim
    data = bytearray(path.read_bytes())
    if victim == "manifest.json":
        manifest = json.loads(data)
        manifest["files"]["model.onnx"]["sha256"] = "0" * 64
        path.write_text(json.dumps(manifest))
    else:
        data[len(data) // 2] ^= 0xFF  # same size, one byte changed
        path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="sha256|changed"):
        infer_paths([data_root / "test" / "blue_square"], bundle_dir)
    out = CliRunner().invoke(main, ["infer", str(data_root / "test" / "blue_square"), "--bundle", str(bundle_dir)])
    assert out.exit_code == 2 and "sha256" in out.stderr and out.stdout == ""
    info = CliRunner().invoke(main, ["info", "--bundle", str(bundle_dir), "--json"])
    assert info.exit_code == 2 and json.loads(info.stdout)["bundle"]["hashes_ok"] is False


def test_unavailable_named_provider_is_an_error(edge_bundle, data_root):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("CUDA provider present")
    out = CliRunner().invoke(main, ["infer", str(data_root / "test"), "--bundle", str(edge_bundle),
                                    "--provider", "cuda", "--json"])
    assert out.exit_code == 2
    assert json.loads(out.stdout)["ok"] is False and "not available" in json.loads(out.stdout)["error"]


def test_info(edge_bundle):
    out = CliRunner().invoke(main, ["info", "--bundle", str(edge_bundle), "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    b, d = report["bundle"], report["device"]
    assert b["hashes_ok"] and b["round"] == 2 and b["precision"] == "fp32" and sorted(b["classes"]) == sorted(CLASSES)
    assert b["lora"]["source"] == "bundle" and len(b["bundle_id"]) == 64
    assert "CPUExecutionProvider" in d["providers"] and d["torch"]["installed"] in (True, False)
    assert d["memory_available_gb"] is None or d["memory_available_gb"] > 0
    text = CliRunner().invoke(main, ["info", "--bundle", str(edge_bundle)])
    assert text.exit_code == 0 and "hashes:   OK" in text.stdout and "providers:" in text.stdout


def test_help_texts():
    for command in ("infer", "train", "rollback", "info"):
        out = CliRunner().invoke(main, [command, "--help"])
        assert out.exit_code == 0 and "Usage:" in out.output and len(out.output) > 300
