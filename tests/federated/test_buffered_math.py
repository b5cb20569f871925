"""The buffered server's update rule (fedmvp/federated/buffered.py): deltas weighted by staleness."""

from __future__ import annotations

import numpy as np
import pytest

from fedmvp.federated.buffered import Contribution, apply_deltas, staleness_weight
from fedmvp.presets.server import ServerRecordError, ServerSpec

THETA = {"lora.a": np.array([1.0, -2.0, 0.5], np.float32), "promptformer.w": np.ones(2, np.float32)}


def contribution(node: int, value: list[float], examples: int, staleness: int = 0, base: int = 0) -> Contribution:
    delta = {"lora.a": np.array(value, np.float64) - THETA["lora.a"]}
    return Contribution(node=node, base=base, staleness=staleness, examples=examples, delta=delta, loss=1.0,
                        bundle_id="b")


@pytest.mark.parametrize("t,a,expected", [(0, 0.5, 1.0), (3, 0.5, 0.5), (8, 0.5, 1 / 3), (3, 0.0, 1.0), (1, 1.0, 0.5)])
def test_staleness_weight_is_one_over_one_plus_t_to_the_a(t, a, expected):
    assert staleness_weight(t, a) == pytest.approx(expected)


def test_fresh_deltas_with_eta_one_are_fedavg_of_the_values():
    replies = [contribution(1, [2.0, 0.0, 1.0], 3), contribution(2, [0.0, 4.0, -1.0], 1)]
    out = apply_deltas(THETA, replies, exponent=0.5, server_lr=1.0)
    fedavg = (3 * np.array([2.0, 0.0, 1.0]) + 1 * np.array([0.0, 4.0, -1.0])) / 4
    np.testing.assert_allclose(out["lora.a"], fedavg.astype(np.float32), rtol=0, atol=1e-7)
    assert out["promptformer.w"] is THETA["promptformer.w"]  # what no delta holds keeps its value


def test_a_stale_delta_moves_theta_by_s_of_t_and_eta_scales_the_step():
    fresh = apply_deltas(THETA, [contribution(1, [3.0, -2.0, 0.5], 2)], 0.5, 1.0)["lora.a"] - THETA["lora.a"]
    stale = apply_deltas(THETA, [contribution(1, [3.0, -2.0, 0.5], 2, staleness=3)], 0.5, 1.0)["lora.a"] - THETA["lora.a"]
    np.testing.assert_allclose(stale, 0.5 * fresh, atol=1e-7)
    flat = apply_deltas(THETA, [contribution(1, [3.0, -2.0, 0.5], 2, staleness=3)], 0.0, 1.0)["lora.a"] - THETA["lora.a"]
    np.testing.assert_allclose(flat, fresh, atol=1e-7)
    half = apply_deltas(THETA, [contribution(1, [3.0, -2.0, 0.5], 2)], 0.5, 0.5)["lora.a"] - THETA["lora.a"]
    np.testing.assert_allclose(half, 0.5 * fresh, atol=1e-7)


def test_arrival_order_never_changes_a_bit():
    replies = [contribution(n, list(np.random.default_rng(n).normal(size=3)), n + 1, staleness=n % 3, base=n % 2)
               for n in range(6)]
    one = apply_deltas(THETA, replies, 0.5, 1.0)["lora.a"]
    other = apply_deltas(THETA, list(reversed(replies)), 0.5, 1.0)["lora.a"]
    assert one.tobytes() == other.tobytes()


@pytest.mark.parametrize("key,value,message", [
    ("mode", "async", "mode must be 'sync' or 'buffered'"),
    ("concurrency", 0, "concurrency and buffer_size must be at least 1"),
    ("buffer_size", 0, "concurrency and buffer_size must be at least 1"),
    ("staleness_exponent", -0.5, "staleness_exponent must be a finite number >= 0"),
    ("server_lr", 0.0, "server_lr must be a finite number > 0"),
])
def test_buffered_server_keys_are_range_checked(key, value, message):
    with pytest.raises(ServerRecordError, match=message):
        ServerSpec().with_overrides({key: value}, "preset.toml")
