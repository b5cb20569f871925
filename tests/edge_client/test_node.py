"""The edge device as a federation node, without Flower processes: its node config, the held-out
share of its images, one round's handler on a real bundle, and `edge-client join`'s checks."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from edge_helpers import write_local_data

from edge_client.bundle import Bundle
from edge_client.local_data import held_out_split, scan_folder
from edge_client.node import EdgeNodeConfig
from tests.deadlines import scaled


def test_node_config_survives_flowers_parser(tmp_path):
    """`edge-client join` writes --node-config text; flower-supernode parses it; the handler reads it back."""
    from flwr.common.config import parse_config_args

    node = EdgeNodeConfig(bundle=tmp_path / "my bundle", data=tmp_path / "it's data", eval_fraction=0.3,
                          out=tmp_path / "up", personalise=True, device="cpu", max_memory_gb=2.5, epochs=3,
                          lr=0.02, optimizer="adamw", batch_size=8, threads=2, runtime="openvino",
                          precision="bf16")
    parsed = parse_config_args([node.to_node_config()])
    assert parsed["role"] == "edge"
    assert EdgeNodeConfig.from_node_config(parsed) == node
    options = node.options(7)
    assert (options.epochs, options.lr, options.optimizer, options.batch_size, options.seed, options.apply) == \
        (3, 0.02, "adamw", 8, 7, True)
    with pytest.raises(RuntimeError, match="without data"):
        EdgeNodeConfig.from_node_config({"bundle": "b"})


def test_the_held_out_share_is_stable_per_class_and_disjoint(edge_bundle, tmp_path):
    classes = Bundle.open(edge_bundle).class_names
    root = write_local_data(tmp_path / "local", classes[:3], per_class=5)
    data = scan_folder(root, classes)
    train, held = held_out_split(data, 0.2)
    again_train, again_held = held_out_split(scan_folder(root, classes), 0.2)
    assert held.files == again_held.files and train.files == again_train.files
    assert len(held) == 3 and len(train) == 12  # one image of each class of five
    assert not set(held.files) & set(train.files) and sorted(held.files + train.files) == sorted(data.files)
    assert held.classes == train.classes == sorted(classes[:3])


def test_one_round_on_the_device_trains_the_global_lora_and_leaves_the_bundle_alone(edge_bundle, bundle_dir,
                                                                                  tmp_path, monkeypatch):
    """The train handler's work (no refresh: the bundle holds the round's PromptFormer). Without ``out``
    the reply carries the trained tensors and nothing is written; with it, the round's update file
    holds exactly what the reply carries."""
    from flwr.app import Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedmvp_formats.messages import Instruction, read_identity

    from fedmvp_formats.packed import packed_records

    from edge_client.node import _arrays, _content, _records, evaluate, train
    from edge_client.update import read_update

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    bundle = Bundle.open(bundle_dir)
    root = write_local_data(tmp_path / "local", bundle.class_names[:2], per_class=4)
    node = EdgeNodeConfig(bundle=bundle_dir, data=root, eval_fraction=0.25,
                          device="cpu", epochs=1, lr=0.05, optimizer="adamw", batch_size=4, threads=1)
    assert node.out is None and "out=" not in node.to_node_config()  # no update file unless asked for
    rng = np.random.default_rng(0)
    start = {k: (v + rng.normal(scale=0.05, size=v.shape)).astype(np.float32) for k, v in bundle.lora().items()}
    config = Instruction(round=3, run_id="r", promptformer_digest=bundle.promptformer_digest,
                         lr=0.1, lora_clients=()).records()["config"]

    def one_round(node: EdgeNodeConfig) -> tuple[Message, Context]:
        context = Context(run_id=1, node_id=5, node_config={"role": "edge", **parse(node)}, state=RecordDict(),
                          run_config={})
        message = Message(content=_content({**packed_records(start), "config": config}), dst_node_id=5,
                          message_type="train")
        return train(message, context), context

    monkeypatch.chdir(tmp_path)  # a relative default (./updates) would land here
    files_before = sorted(tmp_path.rglob("*"))
    before = {p.name: p.read_bytes() for p in bundle_dir.iterdir() if p.is_file()}
    reply, context = one_round(node)
    assert sorted(tmp_path.rglob("*")) == files_before  # no update file, nothing else either
    identity = read_identity(_records(reply.content)["identity"], "r", 3)  # what the server reads of it
    assert identity.role == "edge" and not identity.refreshed and identity.bundle_id == bundle.id
    assert _records(reply.content)["metrics"]["num-examples"] == 6  # 2 classes x 3 training images (1 held out each)
    trained = _arrays(reply.content)  # as the server reads it: packed bytes and their layout
    assert set(trained) == set(start) and any(not np.allclose(trained[k], start[k]) for k in start)
    assert all(v.dtype == np.float32 and list(v.shape) == bundle.lora_shapes[k] for k, v in trained.items())
    assert before == {p.name: p.read_bytes() for p in bundle_dir.iterdir() if p.is_file()}  # nothing changed
    assert not (bundle_dir / "personalised").exists()  # no --personalise: the device's own LoRA is untouched

    kept, _ = one_round(dataclasses.replace(node, out=tmp_path / "updates"))  # asked for: the file is kept
    files = list((tmp_path / "updates").glob("*.safetensors"))
    assert len(files) == 1
    update = read_update(files[0], bundle)
    again = _arrays(kept.content)
    assert set(update.tensors) == set(again) and all(np.array_equal(update.tensors[k], again[k]) for k in again)
    assert all(np.array_equal(again[k], trained[k]) for k in trained)  # same round, same seed: same tensors
    assert update.num_examples == _records(kept.content)["metrics"]["num-examples"] == 6

    sent = _records(reply.content)
    message = Message(content=_content({"arrays": sent["arrays"], "layout": sent["layout"], "config": Instruction(
                          round=3, run_id="r", promptformer_digest=bundle.promptformer_digest,
                          assignment={}).records()["config"]}),
                      dst_node_id=5, message_type="evaluate")
    counts = _records(evaluate(message, context).content)["metrics"]
    assert counts["edge:total"] == 2 and 0 <= counts["edge:correct"] <= 2
    from edge_client import node as edge_node

    (engine,) = [p.engine for p in edge_node._PREDICTORS.values()]
    again = _records(evaluate(message, context).content)["metrics"]  # the next round: the same model, fed its LoRA
    assert dict(again) == dict(counts) and [p.engine for p in edge_node._PREDICTORS.values()] == [engine]


@pytest.mark.parametrize("runtime, precision", [("ort", "auto"), ("openvino", "fp32")])
def test_the_runtime_asked_for_evaluates_the_round(edge_bundle, tmp_path, runtime, precision):
    """`join --runtime/--precision` travel in the node config to the predictor the evaluate handler
    runs (and keeps warm): its engine is that runtime's, and its counts are the ones ONNX Runtime gives."""
    from flwr.app import Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedmvp_formats.messages import Instruction

    from edge_client import node as edge_node
    from fedmvp_formats.packed import packed_records

    from edge_client.node import _content, _records, evaluate

    if runtime == "openvino":
        pytest.importorskip("openvino")
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    bundle = Bundle.open(edge_bundle)
    root = write_local_data(tmp_path / "local", bundle.class_names[:3], per_class=4)
    node = EdgeNodeConfig(bundle=edge_bundle, data=root, eval_fraction=0.5, threads=1, runtime=runtime,
                          precision=precision)
    config = Instruction(round=2, run_id="r", promptformer_digest=bundle.promptformer_digest,
                         assignment={}).records()["config"]
    message = Message(content=_content({**packed_records(bundle.lora()), "config": config}), dst_node_id=5,
                      message_type="evaluate")
    context = Context(run_id=1, node_id=5, node_config={"role": "edge", **parse(node)}, state=RecordDict(),
                      run_config={})
    counts = _records(evaluate(message, context).content)["metrics"]
    (predictor,) = edge_node._PREDICTORS.values()
    assert predictor.engine.runtime == runtime and predictor.choice.candidate.runtime == runtime
    assert predictor.engine.precision == (bundle.precision if precision == "auto" else precision)
    held_out = node.shares(bundle)[1]
    assert counts["edge:total"] == len(held_out) == 6
    from edge_client.infer import Predictor

    reference = Predictor(bundle, threads=1, personalised=False)  # ONNX Runtime fp32: the same top-1 counts
    assert counts["edge:correct"] == edge_node.evaluate_share(reference, held_out)[0]


@pytest.mark.processes  # a refusal (exit 2): no federation starts (tests/process_markers.py)
def test_join_refuses_a_runtime_named_and_unavailable_before_connecting(edge_bundle, tmp_path):
    """`join --runtime openvino` where OpenVINO is missing: one error line, exit 2, no SuperNode started
    (a superlink nobody listens on: connecting would hang, not exit 2)."""
    import os

    from fedmvp_apps.edge_bundle import DISABLED_ENV

    classes = Bundle.open(edge_bundle).class_names
    root = write_local_data(tmp_path / "local", classes[:2], per_class=3)
    args = ["join", "--bundle", str(edge_bundle), "--data", str(root), "--superlink", "127.0.0.1:9", "--insecure",
            "--runtime", "openvino"]
    done = subprocess.run([str(Path(sys.executable).parent / "edge-client"), *args], capture_output=True, text=True,
                          timeout=scaled(120), env={**os.environ, DISABLED_ENV: "openvino"})
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert lines == [f"error: openvino is disabled on this device ({DISABLED_ENV}=openvino)"], done.stderr
    assert "connecting" not in done.stderr


def parse(node: EdgeNodeConfig) -> dict:
    from flwr.common.config import parse_config_args

    return parse_config_args([node.to_node_config()])


@pytest.mark.parametrize("extra, message", [
    (["--superlink", "nohost"], "expected HOST:PORT"),
    (["--superlink", "127.0.0.1:9"], "--root-certificates CA.crt"),
    (["--superlink", "127.0.0.1:9", "--insecure", "--data", "{missing}"], "not a directory"),
    (["--superlink", "127.0.0.1:9", "--insecure", "--bundle", "{missing}"], "not a bundle directory"),
    pytest.param(["--superlink", "127.0.0.1:9", "--insecure", "--device", "cuda"], "CUDA is not available",
                 marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")),
])
@pytest.mark.processes  # a refusal (exit 2): no federation starts (tests/process_markers.py)
def test_join_checks_everything_before_it_starts(edge_bundle, tmp_path, extra, message):
    classes = Bundle.open(edge_bundle).class_names
    root = write_local_data(tmp_path / "local", classes[:2], per_class=3)
    args = ["--bundle", str(edge_bundle), "--data", str(root)] + \
        [a.replace("{missing}", str(tmp_path / "nope")) for a in extra]
    done = subprocess.run([str(Path(sys.executable).parent / "edge-client"), "join", *args], capture_output=True, text=True,
                          timeout=scaled(120))
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in done.stderr


def test_a_bundle_with_another_class_set_is_refused_before_it_trains(bundle_dir, edge_run):
    """The run's class set (the message's record) against the bundle's: order or phrases that differ are
    refused in one line, before any training; the same set passes."""
    import pytest

    from edge_client.bundle import BundleError
    from edge_client.node import check_class_set
    from fedmvp_formats.class_set import ClassSet, phrases_digest

    bundle = Bundle.open(bundle_dir)
    names = bundle.class_names
    assert bundle.classes_digest is not None and len(names) > 1
    # the record with the bundle's names and digest: its per-class digests rebuilt so that the whole matches
    same = ClassSet(tuple(names), tuple(phrases_digest([n]) for n in names))
    reordered = ClassSet(tuple(reversed(names)), same.phrases)
    with pytest.raises(BundleError, match=r"refused before training: .* \(other class order\)"):
        check_class_set(bundle, reordered.record(), "run-b")
    with pytest.raises(BundleError, match=r"other attribute phrases"):
        check_class_set(bundle, same.record(), "run-b")  # same names, other phrases: another digest
    check_class_set(bundle, None, "run-b")  # a run that records none: nothing to compare
    from fedmvp.run_classes import class_set
    from fedmvp.runs import RunDir

    run = class_set(RunDir(edge_run).class_set())  # the exporter recorded the run's own digest
    assert run.digest == bundle.classes_digest
    check_class_set(bundle, run.record(), "edgetest-1")
