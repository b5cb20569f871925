"""Every rule a client reply must pass before it is averaged, one row each (docs/architecture.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedmvp.federated.replies import ReplyRules, check_reply
from fedmvp.presets.server import ServerSpec

GLOBAL = {"lora.a": np.zeros((2, 3), np.float32), "lora.b": np.zeros(4, np.float32)}
GOOD = {"lora.a": np.full((2, 3), 0.1, np.float32), "lora.b": np.full(4, 0.1, np.float32)}
IDENTITY = {"partition-id": 1, "run-id": "r1", "round": 5, "num-examples": 8}


def check(arrays=None, rules=None, **identity):
    metrics = {**IDENTITY, **identity}
    return check_reply(GOOD if arrays is None else arrays, metrics,
                       rules=rules or ReplyRules(run_id="r1", round=5), global_state=GLOBAL,
                       expected_names={0: set(GLOBAL), 1: set(GLOBAL)}, declared_examples={0: 16, 1: 16})


@pytest.mark.parametrize("change,reason", [
    ({"identity": {"partition-id": 7}}, "unknown site 7"),
    ({"identity": {"partition-id": "x"}}, "unknown site 'x'"),
    ({"identity": {"run-id": "r0"}}, "reply of another run ('r0')"),
    ({"identity": {"round": 4}}, "reply of round 4, not of round 5"),
    ({"identity": {"num-examples": 0}}, "num-examples 0 is not a positive integer"),
    ({"identity": {"num-examples": 2.5}}, "num-examples 2.5 is not a positive integer"),
    ({"identity": {"num-examples": 17}}, "num-examples 17 exceeds the site's 16 training images"),
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
    assert all(v.dtype == np.float32 for v in verdict.arrays.values())


def test_an_oversized_update_is_clipped_onto_the_bound_when_so_configured():
    verdict = check(rules=ReplyRules(run_id="r1", round=5, server=ServerSpec(max_update_norm=0.1, update_norm_action="clip")))
    assert verdict.accepted and verdict.clipped_from == pytest.approx(math.sqrt(10 * 0.01))
    norm = math.sqrt(sum(float(np.sum((verdict.arrays[k] - GLOBAL[k]) ** 2)) for k in GLOBAL))
    assert norm == pytest.approx(0.1, rel=1e-5)
    direction = verdict.arrays["lora.a"] / verdict.arrays["lora.b"][0]
    assert np.allclose(direction, 1.0)  # the same direction, a shorter step
