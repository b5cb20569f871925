"""fedmvp-export --format torchscript: the traced inference module in the bundle, hashed and parity-checked."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from export_helpers import rebuilt_model

from edge_client.bundle import BundleError, read_bundle
from export import parity
from export.torchscript_export import quiet_torchscript
from fedmvp_apps.export_cli import main
from fedmvp_formats.files import sha256_file
from fedmvp_formats.parity_rules import FP32_MAX_ABS_DIFF


@pytest.fixture(scope="module")
def ts_bundle(tiny_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("ts-bundles") / "fp32-ts"
    result = CliRunner().invoke(main, ["--run", str(tiny_run), "--out", str(out), "--format", "torchscript",
                                       "--parity-images", "32", "--json"])
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


def test_the_bundle_lists_the_module_with_its_hash(ts_bundle):
    out, report = ts_bundle
    bundle = read_bundle(out)  # every listed sha256 verified
    m = bundle.manifest
    assert m["files_by_role"]["torchscript"] == "model.torchscript.pt"
    assert m["files"]["model.torchscript.pt"]["sha256"] == sha256_file(out / "model.torchscript.pt")
    section = m["torchscript"]
    assert section["format"] == "torch.jit" and section["outputs"] == ["logits", "probs", "image_embeds"]
    assert section["inputs"] == ["pixel_values", *section["lora_inputs"]]
    assert sorted(section["lora_inputs"]) == sorted(m["lora"]["tensors"])
    assert section["promptformer_digest"] == m["promptformer"]["digest"]
    ts = m["parity"]["torchscript"]
    assert ts["passed"] and ts["top1_agreement"] == 1.0 and ts["max_abs_logit_diff"] <= FP32_MAX_ABS_DIFF
    assert report["parity"]["torchscript"]["passed"] and "model.torchscript.pt" in report["sizes"]


def test_the_module_gives_the_pytorch_models_logits(ts_bundle, tiny_run):
    out, _ = ts_bundle
    model, _ = rebuilt_model(tiny_run)  # the run's text features set
    images = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    reference = parity.torch_logits(model, images)
    section = read_bundle(out).manifest["torchscript"]
    lora = {k: torch.from_numpy(v) for k, v in read_bundle(out).lora().items()}
    with quiet_torchscript():
        module = torch.jit.load(str(out / "model.torchscript.pt"))
    for batch in (1, 5, 16):  # the traced batch was 2: the batch dimension stays free
        got = module(images[:batch], *(lora[n] for n in section["lora_inputs"]))[0].detach().numpy()
        assert np.max(np.abs(got - reference[:batch])) <= FP32_MAX_ABS_DIFF
        assert (got.argmax(-1) == reference[:batch].argmax(-1)).all()
    zero = {n: torch.zeros_like(t) if n.endswith("lora_B.weight") else t for n, t in lora.items()}
    other = module(images[:4], *(zero[n] for n in section["lora_inputs"]))[0].detach().numpy()
    assert np.max(np.abs(other - reference[:4])) > FP32_MAX_ABS_DIFF  # the LoRA fed is the LoRA run


def test_a_tampered_module_is_refused_at_load(ts_bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(ts_bundle[0], copy)
    path = copy / "model.torchscript.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="model.torchscript.pt: sha256 does not match"):
        read_bundle(copy)


def test_a_bundle_without_it_has_no_entry(tiny_bundle):
    m = read_bundle(tiny_bundle.path).manifest
    assert "torchscript" not in m and "torchscript" not in m["files_by_role"] and "torchscript" not in m["parity"]


def test_a_torchscript_parity_failure_refuses_the_export(tiny_run, tmp_path, monkeypatch):
    import export.torchscript_export as ts

    real = ts.logits
    monkeypatch.setattr(ts, "logits", lambda *a, **k: real(*a, **k) + 1.0)  # off by a whole logit
    out = tmp_path / "bundle"
    result = CliRunner().invoke(main, ["--run", str(tiny_run), "--out", str(out), "--format", "torchscript",
                                       "--parity-images", "32"])
    assert result.exit_code == 1, result.output
    assert "parity failed, no bundle written: torchscript parity fp32" in result.output
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_the_archive_does_not_carry_a_random_id(tmp_path):
    import io
    import zipfile

    from export.torchscript_export import fixed_serialization_id

    with quiet_torchscript():
        module = torch.jit.trace(torch.nn.Linear(3, 2).eval(), torch.zeros(1, 3), check_trace=False)
        buffer = io.BytesIO()
        torch.jit.save(module, buffer)
    saved = buffer.getvalue()
    record = next(i for i in zipfile.ZipFile(io.BytesIO(saved)).infolist()
                  if i.filename.endswith("/.data/serialization_id"))
    drawn = zipfile.ZipFile(io.BytesIO(saved)).read(record)
    other = saved.replace(drawn, b"1" * len(drawn))  # another draw of torch's random id
    assert other != saved and fixed_serialization_id(other) == fixed_serialization_id(saved)
    path = tmp_path / "m.pt"
    path.write_bytes(fixed_serialization_id(other))
    assert zipfile.ZipFile(path).testzip() is None  # CRCs right
    with quiet_torchscript():
        loaded = torch.jit.load(str(path))
    x = torch.randn(4, 3)
    assert torch.equal(loaded(x), module(x))


def test_the_module_carries_no_path_of_the_exporting_machine(ts_bundle):
    """No ``*.debug_pkl`` (they named the traced Python files by absolute path), every record's data aligned
    to 64 bytes as torch.jit.save aligns it, and the module still loads and runs (examples/cpp reads it too)."""
    import sys
    import zipfile
    from pathlib import Path

    path = ts_bundle[0] / "model.torchscript.pt"
    data = path.read_bytes()
    archive = zipfile.ZipFile(path)
    assert not [i.filename for i in archive.infolist() if i.filename.endswith(".debug_pkl")]
    assert archive.testzip() is None
    for info in archive.infolist():
        name_len, extra_len = int.from_bytes(data[info.header_offset + 26:info.header_offset + 28], "little"), \
            int.from_bytes(data[info.header_offset + 28:info.header_offset + 30], "little")
        assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0, info.filename
    for prefix in {sys.prefix, str(Path(__file__).resolve().parents[2]), str(Path.home())}:
        assert prefix.encode() not in data, prefix
    with quiet_torchscript():
        torch.jit.load(str(path))
