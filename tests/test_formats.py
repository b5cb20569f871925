"""fedmvp_formats, the shared leaf: the PromptFormer digest (one definition for server, exporter and device),
the Flower message schema (one builder and one reader of each record), the one tensor check and the FedMVP
objective (one definition for the server's model and the device's training program)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from fedmvp_formats import messages as schema
from fedmvp_formats.messages import Identity, Instruction, MessageError, read_identity, read_instruction
from fedmvp_formats.promptformer import promptformer_digest
from fedmvp_formats.tensors import first_nonfinite, tensor_problem


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"promptformer.text_proj.bias": rng.standard_normal(8).astype(np.float32),
            "promptformer.block.attn.to_k.weight": rng.standard_normal((8, 8)).astype(np.float32),
            "lora.block.attn.to_q.lora_A.weight": rng.standard_normal((4, 8)).astype(np.float32)}


def test_the_digest_covers_promptformer_names_shapes_and_bytes_only():
    state = _state()
    digest = promptformer_digest(state)
    assert digest == promptformer_digest({k: v for k, v in state.items() if k.startswith("promptformer.")})
    assert digest == promptformer_digest({k: v.astype(np.float64) for k, v in state.items()})  # float32 bytes
    moved = {**state, "promptformer.text_proj.bias": state["promptformer.text_proj.bias"] + 1e-3}
    assert promptformer_digest(moved) != digest
    reshaped = {**state, "promptformer.text_proj.bias": state["promptformer.text_proj.bias"].reshape(1, -1)}
    assert promptformer_digest(reshaped) != digest  # the shape is part of it
    renamed = {k.replace("text_proj", "text_proj2"): v for k, v in state.items()}
    assert promptformer_digest(renamed) != digest


# ---- the message schema ---------------------------------------------------------------------------------
METHOD = {"num_prompts": 4, "heads": 4, "ff_mult": 4, "alpha": 10.0, "flip_prob": 0.5, "lora_rank": 8,
          "lora_targets": ["to_q", "to_k", "to_v"], "use_lora": True}
LOCAL = {"local_epochs": 1, "batch_size": 8, "momentum": 0.9, "weight_decay": 1e-5, "sigma": 0.5}
TRAIN = Instruction(round=3, run_id="r1", promptformer_digest="d" * 64, preset="demo", device="cpu", method=METHOD,
                    lr=0.0029, lora_clients=(), threads=2, local=LOCAL)
EVALUATE = Instruction(round=3, run_id="r1", prompted=False, preset="demo", method=METHOD,
                       assignment={"shapes/new": 0, "shapes/base": 2})
RECORD_VALUES = (int, float, str, bool, bytes)


def _values(records: dict[str, dict]) -> list:
    return [value for record in records.values() for value in record.values()]


@pytest.mark.parametrize("instruction", [TRAIN, EVALUATE, Instruction(round=1, run_id="r")],
                         ids=["train", "evaluate", "bare"])
def test_an_instruction_survives_its_records_exactly(instruction):
    records = instruction.records()
    assert read_instruction(records) == instruction
    assert read_instruction(json.loads(json.dumps(records))) == instruction  # plain values only


@pytest.mark.parametrize("instruction", [TRAIN, EVALUATE], ids=["train", "evaluate"])
def test_no_json_text_travels_every_value_is_a_config_record_value(instruction):
    """Flower's ConfigRecord takes scalars and lists of one scalar type; a mapping is its own record."""
    for value in _values(instruction.records()):
        items = value if isinstance(value, list) else [value]
        assert all(isinstance(v, RECORD_VALUES) for v in items) and len({type(v) for v in items}) <= 1, value
        if isinstance(value, str) and value[:1] in "[{":
            with pytest.raises(ValueError):
                json.loads(value)


@pytest.mark.parametrize("records, reason", [
    ({}, "no config record"),
    ({"config": {"run-id": "r"}}, "round None is not a round number"),
    ({"config": {"round": True, "run-id": "r"}}, "round True"),
    ({"config": {"round": 1}}, "run-id None is not a string"),
    ({"config": {"round": 1, "run-id": "r", "lora-clients": "[1, 2]"}},
     "lora-clients is not a list of integers ('[1, 2]')"),  # JSON text is refused, not parsed
    ({"config": {"round": 1, "run-id": "r", "lora-clients": [1.0]}}, "lora-clients is not a list of integers"),
    ({"config": {"round": 1, "run-id": "r", "threads": 0}}, "threads 0 is not a positive integer"),
    ({"config": {"round": 1, "run-id": "r", "threads": 2.0}}, "threads 2.0 is not a positive integer"),
    ({"config": {"round": 1, "run-id": "r", "lr": float("nan")}}, "lr nan is not a finite number"),
    ({"config": {"round": 1, "run-id": "r", "prompted": 1}}, "prompted 1 is not true or false"),
    ({"config": {"round": 1, "run-id": "r"}, "assignment": {"shapes/new": "0"}}, "does not map set names"),
    ({"config": {"round": 1, "run-id": "r"}, "method": '{"alpha": 1}'}, "the method record is not a mapping"),
])
def test_a_malformed_instruction_is_refused_with_the_reason(records, reason):
    with pytest.raises(MessageError, match=re.escape(reason)):
        read_instruction(records)


def test_a_part_a_reader_needs_is_named_when_absent():
    instruction = read_instruction(Instruction(round=1, run_id="r").records())
    with pytest.raises(MessageError, match="has no method"):
        instruction.need("method")
    assert TRAIN.need("lora-clients") == ()  # empty, but told


SITE = Identity(round=3, run_id="r1", site=2)
EDGE = Identity(round=3, run_id="r1", bundle_id="b" * 64, promptformer_digest="d" * 64, refreshed=True,
                refresh_bytes=123)


@pytest.mark.parametrize("identity", [SITE, EDGE, Identity(round=3, run_id="r1")],
                         ids=["site", "edge", "zero-shot"])
def test_the_identity_record_round_trips(identity):
    record = identity.record()
    assert read_identity(record, "r1", 3) == identity
    assert all(isinstance(v, (int, str)) for v in record.values())  # 0/1, not a bool: one spelling


@pytest.mark.parametrize("change, reason", [
    ({"partition-id": None}, "unknown site None"),
    ({"partition-id": "2"}, "unknown site '2'"),
    ({"partition-id": True}, "unknown site True"),
    ({"round": None}, "reply of round None, not of round 3"),
    ({"round": 3.0}, "reply of round 3.0"),
    ({"round": 4}, "reply of round 4, not of round 3"),
    ({"run-id": None}, "reply of another run (None)"),
    ({"run-id": 7}, "run-id 7 is not a string"),
    ({"run-id": "r" * 200}, "is not a string of at most 128 characters"),
    ({"role": "server"}, "role 'server' is not site or edge"),
])
def test_a_site_identity_with_a_wrong_or_missing_field_is_refused(change, reason):
    fields = {k: v for k, v in {**SITE.record(), **change}.items() if v is not None}
    with pytest.raises(MessageError, match=re.escape(reason)):
        read_identity(fields, "r1", 3)


@pytest.mark.parametrize("change, reason", [
    ({"refreshed": 2}, "refreshed 2 is not 0 or 1"),
    ({"refreshed": 1.0}, "refreshed 1.0 is not 0 or 1"),
    ({"refresh-bytes": -1}, "refresh-bytes -1 is not a byte count"),
    ({"refresh-bytes": "12"}, "refresh-bytes '12' is not a byte count"),
    ({"bundle-id": ["b"]}, "bundle-id a list is not a string"),
    ({"promptformer-digest": b"d"}, "promptformer-digest b'd' is not a string"),
])
def test_an_edge_identity_with_a_wrong_field_is_refused(change, reason):
    with pytest.raises(MessageError, match=re.escape(reason)):
        read_identity({**EDGE.record(), **change}, "r1", 3)


def test_train_metrics_and_counts():
    metrics = schema.train_metrics(8, 0.5, ce=0.4, consistency=0.1, lora_active=True, switch_next=False)
    assert metrics == {"num-examples": 8, "train-loss": 0.5, "train-ce": 0.4, "train-consistency": 0.1,
                       "lora-active": 1, "switch-next": 0}
    schema.check_train_metrics(metrics)
    for bad, reason in (({"switch-next": 2}, "switch-next 2"), ({"train-loss": float("nan")}, "train-loss nan"),
                        ({"train-loss": None}, "train-loss None"),
                        ({"train-loss": 1e308}, "train-loss 1e+308 is not within -1e+06 to 1e+06"),
                        ({"train-ce": -3e38}, "train-ce -3e+38 is not within"),
                        ({"refresh-seconds": 1e12}, "refresh-seconds 1000000000000.0 is not within -1e+07")):
        with pytest.raises(MessageError, match=re.escape(reason)):
            schema.check_train_metrics({k: v for k, v in {**metrics, **bad}.items() if v is not None})
    counts = schema.count_metrics({"local": (3, 4), "edge": (0, 2)})
    assert schema.count_sets(counts) == {"local", "edge"} and schema.count_pair(counts, "local") == (3, 4)
    assert schema.count_pair({"a:correct": 5, "a:total": 4}, "a") is None


@pytest.mark.parametrize("record, reason", [
    ({"cat": 3, "dog": 0}, None),
    ({"cat": 3.0}, "classes cat: 3.0 is not a count of images"),
    ({"cat": -1}, "classes cat: -1 is not a count of images"),
    ({"cat": False}, "classes cat: False is not a count of images"),
    ({"cat\x1b[31m": "3"}, "classes 'cat\\x1b[31m': '3' is not a count of images"),
    (["cat", 3], "the classes record is not a mapping"),
])
def test_a_replys_class_counts_are_image_counts(record, reason):
    """A train reply's classes record: class name -> training images, read by the one reader."""
    if reason is None:
        assert schema.read_class_counts(record) == record
        return
    with pytest.raises(MessageError, match=re.escape(reason)):
        schema.read_class_counts(record)


# ---- the one tensor check -------------------------------------------------------------------------------
SHAPES = {"lora.a": [2, 3], "lora.b": [4]}


@pytest.mark.parametrize("tensors, reason", [
    ({"lora.a": np.zeros((2, 3), np.float32), "lora.b": np.zeros(4, np.float32)}, None),
    ({"lora.a": np.zeros((2, 3), np.float32)}, "tensor names do not match the bundle (missing lora.b)"),
    ({**{f"lora.x{i}": np.zeros(1) for i in range(5)}, "lora.a": np.zeros((2, 3)), "lora.b": np.zeros(4)},
     "(unexpected lora.x0, lora.x1, lora.x2 and 2 more)"),
    ({"lora.a": np.zeros((3, 2), np.float32), "lora.b": np.zeros(4, np.float32)},
     "lora.a: shape [3, 2], the bundle's is [2, 3]"),
    ({"lora.a": np.zeros((2, 3), np.float64), "lora.b": np.zeros(4, np.float32)},
     "lora.a: dtype float64 is not float32"),
    ({"lora.a": np.zeros((2, 3), np.float32), "lora.b": np.array([0, 0, np.inf, 0], np.float32)},
     "lora.b: holds NaN or infinite values"),
], ids=["good", "missing", "unexpected", "shape", "dtype", "inf"])
def test_the_tensor_check_names_the_first_problem(tensors, reason):
    problem = tensor_problem(tensors, SHAPES, of="the bundle")
    assert problem == reason if reason is None or reason.startswith("lora.") or reason.startswith("tensor") \
        else reason in problem


def test_any_floating_dtype_when_none_is_required_and_the_first_nonfinite_name():
    assert tensor_problem({"a": np.zeros(2, np.float16)}, {"a": [2]}, dtype=None) is None
    assert tensor_problem({"a": np.zeros(2, np.int32)}, {"a": [2]}, dtype=None) == \
        "a: dtype int32 is not floating point"
    assert first_nonfinite({"b": np.array([np.nan]), "a": np.zeros(1), "c": np.array([np.inf])}) == "b"
    assert first_nonfinite({"i": np.array([1, 2])}) is None


# ---- the FedMVP objective (docs/method.md §5), the one the server's model and the device's program train ----
def test_the_objective_is_cross_entropy_alone_when_alpha_is_zero():
    import torch
    import torch.nn.functional as F

    from fedmvp_formats.objective import consistency_on, fedmvp_objective

    logits = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.2, 3.0]])
    labels = torch.tensor([0, 1])
    features = F.normalize(torch.randn(2, 4, generator=torch.Generator().manual_seed(0)), dim=-1)
    out = fedmvp_objective(features, logits, None, labels, 0.0, F)  # no frozen targets needed
    assert not consistency_on(0.0) and consistency_on(1e-3)
    assert torch.equal(out["loss"], out["ce"]) and torch.equal(out["ce"], F.cross_entropy(logits, labels))
    assert out["consistency"].dtype == torch.float32 and float(out["consistency"]) == 0.0
    ignored = fedmvp_objective(features, logits, -features, labels, 0.0, F)  # targets given: still unused
    assert torch.equal(ignored["loss"], out["loss"]) and float(ignored["consistency"]) == 0.0
    with pytest.raises(ValueError, match="frozen targets"):
        fedmvp_objective(features, logits, None, labels, 10.0, F)


def test_the_consistency_term_on_known_vectors():
    import torch
    import torch.nn.functional as F

    from fedmvp_formats.objective import fedmvp_objective

    features = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    frozen = torch.tensor([[1.0, 0.0], [1.0, 0.0], [-1.0, 0.0]])  # cos 1, 0, -1: 1 - cos = 0, 1, 2
    logits = torch.zeros(3, 4)
    labels = torch.tensor([0, 1, 2])
    out = fedmvp_objective(features, logits, frozen, labels, 10.0, F)
    assert float(out["consistency"]) == pytest.approx(1.0)
    assert float(out["ce"]) == pytest.approx(math.log(4))  # uniform logits over 4 classes
    assert float(out["loss"]) == pytest.approx(math.log(4) + 10.0)
    # low precision in, float32 out: autocast's bf16 never reaches the loss
    low = fedmvp_objective(features.bfloat16(), logits.bfloat16(), frozen.bfloat16(), labels, 10.0, F)
    assert all(v.dtype == torch.float32 for v in low.values()) and torch.equal(low["loss"], out["loss"])
