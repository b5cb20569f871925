"""fedmvp-export end to end on the tiny model: bundle contents, ONNX graph, parity, LoRA swap, determinism."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
from onnx import numpy_helper
import onnxruntime as ort
import torch
from click.testing import CliRunner
from export_helpers import NUM_CLASSES, rebuilt_model

from edge_client.bundle import read_bundle
from fedmvp_apps.export_cli import main
from fedmvp.runs import RunDir

LORA = [f"lora.block.attn.to_{t}.lora_{p}.weight" for t in "qkv" for p in "AB"]


def _session(path, options=None):
    options = options or ort.SessionOptions()
    options.log_severity_level = 3  # ORT warns that overridable initializers are not constant-folded
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def test_bundle_manifest_and_files(tiny_bundle, tiny_run):
    bundle = read_bundle(tiny_bundle.path)  # verifies every sha256
    m = bundle.manifest
    assert m["format_version"] == 2 and m["precision"] == "fp32"
    config = rebuilt_model(tiny_run)[0].config  # the method config is recorded for the edge trainer (alpha)
    assert bundle.method == config.to_dict() and m["method"] == config.to_dict()  # with its version
    assert bundle.method["lora_rank"] == 4 and bundle.round == 2 and len(bundle.id) == 64  # the run recorded rank 4
    assert m["source"]["round"] == 2 and m["source"]["run"] == tiny_run.name
    assert m["model"]["clip"] == "fedmvp-tiny"
    federation = RunDir(tiny_run).federation()
    base, new = (next(e.class_names for e in federation.evaluations if e.kind == k) for k in ("base", "new"))
    assert bundle.class_names == base + new and len(base) == 8 and len(new) == 4  # base first, then new
    assert bundle.preprocess.image_size == 32 and m["preprocess"]["resize"] == "bicubic-shortest-side"
    assert set(m["files"]) == {"model.onnx", "train.pt2", "lora.safetensors", "weights.safetensors",
                               "text_features.safetensors", "check_images.safetensors"}
    assert sorted(m["lora"]["tensors"]) == sorted(LORA)
    assert m["lora"]["tensors"][LORA[0]] == [4, 128]
    fp32 = m["parity"]["fp32"]
    assert fp32["passed"] and fp32["images"] >= 32
    assert fp32["max_abs_logit_diff"] <= 1e-3 and fp32["top1_agreement"] == 1.0
    assert m["parity"]["images"] == {"run": 72, "synthetic": 0}  # every test image of the run, up to 256
    assert set(bundle.lora()) == set(LORA)


def test_onnx_graph(tiny_bundle):
    path = tiny_bundle.path / "model.onnx"
    onnx.checker.check_model(str(path))
    model = onnx.load(str(path), load_external_data=False)
    assert model.opset_import[0].version >= 17
    assert [i.name for i in model.graph.input] == ["pixel_values", *LORA]  # LoRA: overridable initializers
    assert [o.name for o in model.graph.output] == ["logits", "probs", "image_embeds"]
    inits = {i.name: i for i in model.graph.initializer}
    assert set(LORA) <= set(inits)
    assert all(inits[n].data_location != onnx.TensorProto.EXTERNAL for n in LORA)
    external = [i for i in inits.values() if i.data_location == onnx.TensorProto.EXTERNAL]
    assert external and all(e.external_data[0].value == "weights.safetensors" for e in external)
    assert not any(n.startswith("text_encoder") or "token_embedding" in n for n in inits)  # no text encoder
    session = _session(path)
    assert [i.name for i in session.get_inputs()] == ["pixel_values"]
    for batch in (1, 3, 40):  # dynamic batch (traced at 2)
        logits, probs, embeds = session.run(None, {"pixel_values": np.zeros((batch, 3, 32, 32), np.float32)})
        assert logits.shape == (batch, NUM_CLASSES) and probs.shape == (batch, NUM_CLASSES) and embeds.shape == (batch, 128)
        np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
        np.testing.assert_allclose(np.linalg.norm(embeds, axis=-1), 1.0, atol=1e-5)


def replace_initializers(proto: onnx.ModelProto, tensors: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``proto`` with named initializers replaced (same shape; stored as fp32)."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    found = {init.name: init for init in out.graph.initializer}
    for name, value in tensors.items():
        if name not in found:
            raise KeyError(f"no initializer named {name}")
        if list(found[name].dims) != list(np.shape(value)):
            raise ValueError(f"{name}: shape {list(np.shape(value))} != {list(found[name].dims)}")
        found[name].CopyFrom(numpy_helper.from_array(np.asarray(value, dtype=np.float32), name))
    return out


def test_lora_initializers_swap_like_pytorch(tiny_bundle, tiny_run, tmp_path):
    """Replacing the LoRA initializers changes the ONNX outputs exactly as loading them in PyTorch does."""
    model, _ = rebuilt_model(tiny_run)
    generator = torch.Generator().manual_seed(7)
    new = {n: torch.randn(model.state("lora")[n].shape, generator=generator) * 0.3 for n in LORA}
    model.load_state(new)
    images = torch.randn(8, 3, 32, 32, generator=generator)
    with torch.no_grad():
        expected = model(images).numpy()

    work = tmp_path / "swap"
    shutil.copytree(tiny_bundle.path, work)
    proto = onnx.load(str(work / "model.onnx"), load_external_data=False)
    swapped = replace_initializers(proto, {k: v.numpy() for k, v in new.items()})
    (work / "swapped.onnx").write_bytes(swapped.SerializeToString())
    got = _session(work / "swapped.onnx").run(None, {"pixel_values": images.numpy()})[0]
    np.testing.assert_allclose(got, expected, atol=1e-4)
    before = _session(work / "model.onnx").run(None, {"pixel_values": images.numpy()})[0]
    assert np.abs(before - got).max() > 1e-3  # LoRA matters

    # Same without touching the file: ONNX Runtime overrides initializers by name at session creation.
    options = ort.SessionOptions()
    values = [ort.OrtValue.ortvalue_from_numpy(v.numpy()) for v in new.values()]
    for name, value in zip(new, values):
        options.add_initializer(name, value)
    got = _session(work / "model.onnx", options).run(None, {"pixel_values": images.numpy()})[0]
    np.testing.assert_allclose(got, expected, atol=1e-4)
    # ... or per call, as extra feeds.
    feeds = {"pixel_values": images.numpy(), **{k: v.numpy() for k, v in new.items()}}
    np.testing.assert_allclose(_session(work / "model.onnx").run(None, feeds)[0], expected, atol=1e-4)


def test_same_round_twice_is_byte_identical_and_force_replaces(tiny_bundle, tmp_path):
    first = {p.name: p.read_bytes() for p in tiny_bundle.path.iterdir()}
    out = tmp_path / "again"
    shutil.copytree(tiny_bundle.path, out)
    (out / "stale.txt").write_text("from an older export")
    run = tiny_bundle.manifest["source"]["run_path"]
    result = CliRunner().invoke(main, ["--run", run, "--out", str(out), "--force", "--json"])  # round: the last
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert report["ok"] and report["round"] == 2 and report["total_bytes"] == sum(report["sizes"].values())
    second = {p.name: p.read_bytes() for p in out.iterdir()}
    assert second.keys() == first.keys()  # the old directory was replaced, not merged
    assert [n for n in first if first[n] != second[n]] == []
    assert not list(out.parent.glob("again.*"))  # no temp or old directories left


def test_defaults_newest_run_last_round_and_out_path(tiny_run, tmp_path):
    import os

    from export.bundle_writer import default_out
    from export.run_inputs import find_run, load_checkpoint
    from fedmvp.runs import RunDir

    runs = tmp_path / "runs"
    for i, name in enumerate(["older", "newer", "no-config"]):
        (runs / name).mkdir(parents=True)
        if name != "no-config":
            (runs / name / "config.json").write_text("{}")
        os.utime(runs / name, (1000 + i, 1000 + i))
    assert find_run(None, runs).path.name == "newer"  # the newest directory holding a config.json
    assert load_checkpoint(RunDir(tiny_run), None).round == 2  # the last complete round
    assert default_out(tiny_run, 2, "fp16") == tiny_run / "bundles" / "round-0002-fp16"


def test_attributes_file_bakes_untrained_classes(tiny_run, tmp_path):
    attrs = {"glass_teapot": ["a curved spout", "transparent walls", "a round lid"],
             "wooden_ladder": ["parallel rails", "evenly spaced rungs", "a brown grain"]}
    path = tmp_path / "new_classes.json"
    path.write_text(json.dumps(attrs))
    out = tmp_path / "novel"
    result = CliRunner().invoke(main, ["--run", str(tiny_run), "--attributes", str(path), "--out", str(out),
                                       "--domain", "sketch", "--parity-images", "32"])
    assert result.exit_code == 0, result.output
    bundle = read_bundle(out)
    assert bundle.class_names == ["glass_teapot", "wooden_ladder"]
    assert bundle.manifest["classes"]["source"] == str(path)
    logits = _session(out / "model.onnx").run(None, {"pixel_values": np.zeros((2, 3, 32, 32), np.float32)})[0]
    assert logits.shape == (2, 2)


def test_noise_images_only_fill_up_to_the_parity_minimum():
    from export.run_inputs import topped_up as _topped_up
    from export.parity import MIN_IMAGES

    real = torch.ones(10, 3, 32, 32)
    filled = _topped_up(real, 32, seed=0)
    assert len(filled) == MIN_IMAGES and torch.equal(filled[:10], real)
    assert len(_topped_up(torch.zeros(0), 32, seed=0)) == MIN_IMAGES
    assert len(_topped_up(torch.ones(MIN_IMAGES + 8, 3, 32, 32), 32, seed=0)) == MIN_IMAGES + 8  # no noise added
