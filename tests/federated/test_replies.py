"""Every rule a client reply must pass before it is averaged, one row each (docs/architecture.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedmvp.federated.replies import ClassRules, ReplyRules, check_reply
from fedmvp.presets.server import ServerSpec

GLOBAL = {"lora.a": np.zeros((2, 3), np.float32), "lora.b": np.zeros(4, np.float32)}
GOOD = {"lora.a": np.full((2, 3), 0.1, np.float32), "lora.b": np.full(4, 0.1, np.float32)}
IDENTITY = {"partition-id": 1, "run-id": "r1", "round": 5, "num-examples": 8, "classes": {"cat": 5, "dog": 3}}


# The run record: site 1 holds cat and dog; "seven" is a held-out new class, never trained on anywhere.
CLASSES = ClassRules.from_record({"clients": [{"id": 0, "classes": ["ant"]}, {"id": 1, "classes": ["cat", "dog"]}],
                                  "evaluations": [{"classes": ["seven"]}]})


def check(arrays=None, rules=None, **identity):
    metrics = {k: v for k, v in {**IDENTITY, **identity}.items() if v is not None}
    return check_reply(GOOD if arrays is None else arrays, metrics,
                       rules=rules or ReplyRules(run_id="r1", round=5), global_state=GLOBAL,
                       expected_names={0: set(GLOBAL), 1: set(GLOBAL)}, declared_examples={0: 16, 1: 16},
                       class_rules=CLASSES)


@pytest.mark.parametrize("change,reason", [
    ({"identity": {"partition-id": 7}}, "unknown site 7"),
    ({"identity": {"partition-id": "x"}}, "unknown site 'x'"),
    ({"identity": {"run-id": "r0"}}, "reply of another run ('r0')"),
    ({"identity": {"round": 4}}, "reply of round 4, not of round 5"),
    ({"identity": {"num-examples": 0}}, "num-examples 0 is not a positive integer"),
    ({"identity": {"num-examples": 2.5}}, "num-examples 2.5 is not a positive integer"),
    ({"identity": {"num-examples": 17}}, "num-examples 17 exceeds the site's 16 training images"),
    ({"identity": {"classes": None}}, "no classes record (a site says its training images per class)"),
    ({"identity": {"classes": {"cat": 5}}}, "classes count 5 images, num-examples 8"),
    ({"identity": {"classes": {"cat": 9, "dog": -1}}}, "classes dog: -1 is not a count of images"),
    ({"identity": {"classes": {"cat": 8, "seven": 0}}}, "classes: 'seven' is not in site 1's classes in the run's record"),
    ({"identity": {"classes": [8]}}, "the classes record is not a mapping"),
    ({"arrays": {"lora.a": GOOD["lora.a"]}}, "tensor names do not match the round (missing lora.b)"),
    ({"arrays": {**GOOD, "promptformer.x": GOOD["lora.b"]}}, "unexpected promptformer.x"),
    ({"arrays": {**GOOD, "lora.b": np.zeros(5, np.float32)}}, "lora.b: shape [5], the round's is [4]"),
    ({"arrays": {**GOOD, "lora.b": np.zeros(4, np.int32)}}, "lora.b: dtype int32 is not float32"),
    ({"arrays": {**GOOD, "lora.b": np.array([0, np.nan, 0, 0], np.float32)}}, "lora.b: holds NaN or infinite"),
    ({"arrays": {**GOOD, "lora.a": np.full((2, 3), np.inf, np.float32)}}, "lora.a: holds NaN or infinite"),
    ({"rules": ReplyRules(run_id="r1", round=5, server=ServerSpec(max_update_norm=0.1))}, "update norm 0.3162 exceeds the bound 0.1"),
])
def test_a_reply_breaking_a_rule_is_left_out_with_the_reason(change, reason):
    verdict = check(change.get("arrays"), change.get("rules"), **change.get("identity", {}))
    assert not verdict.accepted and reason in verdict.reason


def test_a_good_reply_is_accepted_as_float32():
    verdict = check()
    assert verdict.accepted and verdict.site == 1 and verdict.clipped_from is None
    assert verdict.classes == {"cat": 5, "dog": 3}  # what the round's state.json records for it
    assert all(v.dtype == np.float32 for v in verdict.arrays.values())


def test_an_oversized_update_is_clipped_onto_the_bound_when_so_configured():
    verdict = check(rules=ReplyRules(run_id="r1", round=5, server=ServerSpec(max_update_norm=0.1, update_norm_action="clip")))
    assert verdict.accepted and verdict.clipped_from == pytest.approx(math.sqrt(10 * 0.01))
    norm = math.sqrt(sum(float(np.sum((verdict.arrays[k] - GLOBAL[k]) ** 2)) for k in GLOBAL))
    assert norm == pytest.approx(0.1, rel=1e-5)
    direction = verdict.arrays["lora.a"] / verdict.arrays["lora.b"][0]
    assert np.allclose(direction, 1.0)  # the same direction, a shorter step


def test_a_site_whose_folder_the_server_cannot_see_is_bounded_by_site_max_examples(tmp_path):
    """A [federation] site with shots unset: the run record has no bound (train_images None), so the
    preset's [server] site_max_examples is what its claimed FedAvg weight may reach."""
    from fedmvp.presets.schema import load_preset

    preset = tmp_path / "p.toml"
    preset.write_text('name = "f"\nprotocol = "base-to-new"\n[train]\nrounds = 1\n[server]\nsite_max_examples = 9\n'
                      '[[datasets]]\nname = "s"\nlayout = "synthetic"\nroot = ""\n')
    rules = ReplyRules(run_id="r1", round=5, server=load_preset(str(preset), check_roots=False).server)

    def verdict(examples):
        return check_reply(GOOD, {**IDENTITY, "num-examples": examples, "classes": {"cat": examples}}, rules=rules,
                           global_state=GLOBAL, expected_names={1: set(GLOBAL)}, declared_examples={1: None})
    assert verdict(9).accepted
    assert "num-examples 10 exceeds a site's bound ([server] site_max_examples 9)" in verdict(10).reason


@pytest.mark.parametrize("name, accepted", [("site-b", True), ("site-a", False), (None, False)])
def test_a_named_site_must_carry_the_name_of_the_site_it_claims(name, accepted):
    """A [federation] site's id is its place among [[sites]]: a reply claiming site 1 under another
    name (or none) is left out, so one node cannot speak for another site."""
    metrics = {**IDENTITY, **({"site-name": name} if name is not None else {})}
    verdict = check_reply(GOOD, metrics, rules=ReplyRules(run_id="r1", round=5), global_state=GLOBAL,
                          expected_names={0: set(GLOBAL), 1: set(GLOBAL)}, declared_examples={0: 16, 1: 16},
                          site_names={0: "site-a", 1: "site-b"})
    assert verdict.accepted is accepted
    if not accepted:
        assert "is not site 1's ('site-b')" in verdict.reason


def test_a_sites_class_counts_are_its_training_images_per_class():
    """What a site's train reply says it trained on: its classes in its order, adding up to its examples."""
    from types import SimpleNamespace

    from fedmvp.federated.task import train_class_counts

    client = SimpleNamespace(class_names=["dog", "cat", "ant"], train=[("a", 1), ("b", 0), ("c", 1), ("d", 1)])
    assert list(train_class_counts(client).items()) == [("dog", 1), ("cat", 3), ("ant", 0)]
