"""The exporter puts LoRA exactly where the run's method record says (``lora_targets``), not on q, k, v
regardless: the bundle's LoRA tensors, ONNX inputs, training program and manifest follow the record."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from export_helpers import write_dataset, write_preset, write_run

from edge_client.bundle import read_bundle
from export.bundle_writer import export_bundle
from export.errors import ExportError


def names(targets: tuple[str, ...]) -> list[str]:
    return [f"lora.block.attn.{t}.lora_{p}.weight" for t in targets for p in "AB"]


CASES = [  # recorded targets -> the LoRA tensors the bundle carries, in graph order (q, k, v)
    (("to_q", "to_v"), names(("to_q", "to_v"))),
    (("to_v", "to_k"), names(("to_k", "to_v"))),  # the record's order does not reorder the graph's inputs
]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-targets-data")
    write_dataset(root)
    return root


def make_run(root, data_root, targets: tuple[str, ...]):
    write_preset(root / "preset.toml", data_root)
    run = root / "runs" / "exporttest-1"
    write_run(run, root / "preset.toml", lora_targets=targets)
    return run


@pytest.mark.parametrize(("targets", "expected"), CASES, ids=["q+v", "v+k"])
def test_bundle_carries_the_recorded_lora_targets(tmp_path, data_root, targets, expected):
    result = export_bundle(make_run(tmp_path, data_root, targets), 2, tmp_path / "bundle")
    bundle = read_bundle(result.path)
    m = bundle.manifest
    assert bundle.method["lora_targets"] == list(targets)
    assert list(m["lora"]["tensors"]) == expected and sorted(bundle.lora()) == sorted(expected)
    assert m["onnx"]["lora_initializers"] == expected
    assert m["parity"]["fp32"]["passed"]  # the graph without the unrecorded delta matches PyTorch
    graph = onnx.load(str(result.path / "model.onnx"), load_external_data=False)
    assert [i.name for i in graph.graph.input] == ["pixel_values", *expected]

    session = ort.InferenceSession(str(result.path / "model.onnx"), providers=["CPUExecutionProvider"])
    images = np.random.default_rng(0).normal(size=(4, 3, 32, 32)).astype(np.float32)
    feeds = {"pixel_values": images, **bundle.lora()}
    base = session.run(["logits"], feeds)[0]
    for name in expected:  # each recorded LoRA tensor is live in the graph
        if name.endswith("lora_B.weight"):
            moved = session.run(["logits"], {**feeds, name: feeds[name] + 0.5})[0]
            assert not np.allclose(moved, base, atol=1e-4), name


def test_the_device_trains_exactly_the_recorded_lora(tmp_path, data_root):
    """The training program's LoRA inputs follow the record too: an update holds q and v, no k."""
    from edge_client.train import train_local
    from edge_client.update import read_update

    result = export_bundle(make_run(tmp_path, data_root, ("to_q", "to_v")), 2, tmp_path / "bundle")
    bundle = read_bundle(result.path)
    local = tmp_path / "local"  # an ImageFolder of the bundle's first classes, from the world's test images
    for name in bundle.class_names[:3]:
        shutil.copytree(data_root / "photo" / "test" / name, local / name)
    trained = train_local(local, bundle, epochs=1, batch_size=4, apply=False,
                          out=tmp_path / "updates", threads=1)
    update = read_update(trained.update_path, bundle)
    assert sorted(update.tensors) == sorted(names(("to_q", "to_v")))
    assert any(not np.array_equal(update.tensors[n], bundle.lora()[n]) for n in update.tensors)


def test_targets_the_edge_graph_cannot_split_are_refused(tmp_path, data_root):
    run = make_run(tmp_path, data_root, ("to_q", "to_out"))
    with pytest.raises(ExportError, match="to_out"):
        export_bundle(run, 2, tmp_path / "bundle")
    assert not (tmp_path / "bundle").exists()
