"""Tensors travel packed: .npy bytes and their layout, read back exactly (fedmvp_formats.packed).

Hostile packed replies are the rows of test_reply_attacks.py; here: what a sender packs is what a
reader gets, whatever the names and shapes, and a message's object count does not grow with its
tensor count (what made the SuperLink the bottleneck of a deployed round, docs/benchmarks.md "deploy")."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord

from fedmvp_formats.messages import MessageError
from fedmvp_formats.packed import LAYOUT, PACKED, pack, read_layout, read_wire

from fedmvp.federated.wire import content_state, message_objects, records_content, state_records

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("state", [
    {"promptformer.w": RNG.normal(size=(3, 4)).astype(np.float32)},
    {"lora.b": RNG.normal(size=(2, 5)), "lora.a": RNG.normal(size=(5,)), "promptformer.s": np.float32(2.5)},
    {"a.empty": np.zeros((0, 3), np.float32), "b.deep": RNG.normal(size=(1, 2, 1, 3, 1, 2, 1, 2)).astype(np.float32)},
    {f"promptformer.t{i:03d}": RNG.normal(size=(i % 4 + 1, 3)).astype(np.float32) for i in range(120)},
], ids=["one", "unsorted-float64-scalar", "empty-and-rank-8", "120-tensors"])
def test_what_is_packed_is_read_back_exactly(state):
    content = records_content(state_records(state))
    back = content_state(content)
    assert list(back) == sorted(state)  # sorted order, whatever the dict's
    for name, value in state.items():
        want = np.asarray(value, np.float32)
        assert back[name].dtype == np.float32 and back[name].shape == want.shape
        np.testing.assert_array_equal(back[name], want)
        assert back[name].flags.writeable  # a copy of its own, not a view of the message's bytes


def test_no_tensors_is_no_records():
    assert state_records({}) == {}
    assert content_state(records_content({})) == {}


def test_a_messages_objects_do_not_grow_with_its_tensors():
    """Flower stores each Array (and its chunks) as objects of their own, each one SuperLink request:
    per-name arrays made 51 objects of the demo's 26 tensors; packed bytes in the one record, any count
    is the RecordDict and its record (the Message is the third: test_wire_objects.py)."""
    few = {f"lora.t{i}": np.full(4, i, np.float32) for i in range(2)}
    many = {f"lora.t{i}": np.full(4, i, np.float32) for i in range(200)}
    assert message_objects(records_content(state_records(few))) == 2
    assert message_objects(records_content(state_records(many))) == 2
    per_name = ArrayRecord({k: Array(v) for k, v in many.items()})
    assert message_objects(per_name) > 200


def test_the_layout_is_plain_lists_in_order():
    flat, layout = pack({"b": np.ones((2, 3), np.float32), "a": np.zeros(4, np.float32)})
    assert layout == {"names": ["a", "b"], "ranks": [1, 2], "dims": [4, 2, 3]}
    assert flat.tolist() == [0.0] * 4 + [1.0] * 6
    assert read_layout(ConfigRecord(layout)) == {"a": (4,), "b": (2, 3)}


@pytest.mark.parametrize("expected,reason", [
    ({"a": (4,), "b": (2, 3)}, None),
    ({"a": (4,)}, "unexpected b"),
    ({"a": (4,), "b": (2, 3), "c": (1,)}, "missing c"),
    ({"a": (4,), "b": (3, 2)}, "b: shape [2, 3], the round's is [3, 2]"),
], ids=["exact", "extra", "missing", "shape"])
def test_a_reader_that_expects_names_and_shapes_holds_the_layout_to_them(expected, reason):
    records = state_records({"b": np.ones((2, 3), np.float32), "a": np.zeros(4, np.float32)})
    if reason is None:
        assert set(read_wire(records["arrays"], records[LAYOUT], expected)) == set(expected)
    else:
        with pytest.raises(MessageError, match=reason.replace("[", r"\[").replace("]", r"\]")):
            read_wire(records["arrays"], records[LAYOUT], expected)


def test_the_packed_bytes_are_one_float32_vector():
    records = state_records({"a": np.ones((2, 2), np.float32)})
    back = np.load(__import__("io").BytesIO(records["arrays"][PACKED]), allow_pickle=False)
    assert (back.dtype, back.shape) == (np.float32, (4,))


@pytest.mark.parametrize("dims", [[2 ** 32, 2 ** 32], [2 ** 62, 4], [2 ** 31 + 1]], ids=["2**64", "2**64-b", "over-bound"])
def test_a_layout_declaring_more_values_than_a_message_holds_is_refused_before_any_read(dims):
    """int64 products wrap (2**32 * 2**32 is 0 in int64): sizes are exact integers, bounded."""
    layout = {"names": ["promptformer.w"], "ranks": [len(dims)], "dims": dims}
    arrays = state_records({"promptformer.w": np.zeros(0, np.float32)})["arrays"]
    with pytest.raises(MessageError, match="values declared"):
        read_wire(arrays, layout)


def test_packed_values_that_are_not_bytes_are_refused():
    records = state_records({"a": np.ones(2, np.float32)})
    with pytest.raises(MessageError, match="is not bytes"):
        read_wire({PACKED: "text"}, records[LAYOUT])


def test_a_rounds_tensors_are_packed_once_for_every_site_of_an_open_federation():
    """Each site of an open federation gets a content of its own (its id), the tensors packed once and
    shared: not re-packed and re-hashed per site on the round's hot path."""
    from fedmvp_formats.messages import Instruction

    from fedmvp.federated.wire import content_instruction, node_contents

    arrays = ArrayRecord({"lora.a": Array(RNG.normal(size=(4, 3)).astype(np.float32))})
    instruction = Instruction(round=3, run_id="r1")
    content = node_contents(instruction, ConfigRecord({"x": 1}), lambda node: node % 3)
    made = [content(node, arrays) for node in range(6)]
    assert [content_instruction(c).site for c in made[:3]] == [0, 1, 2]
    assert made[0] is made[3] and made[0] is not made[1]  # one content per site
    packed = made[0]["fedmvp"]["arrays.tensors"]
    assert all(c["fedmvp"]["arrays.tensors"] is packed for c in made)  # the bytes of one packing, shared
    np.testing.assert_array_equal(content_state(made[2])["lora.a"], arrays["lora.a"].numpy())
