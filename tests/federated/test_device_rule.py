"""Device rounds are robust by default, rules declare central DP, and every update has a norm bound.

docs/howto/robust.md ("Devices: a robust default"): a round whose updates all come from edge devices goes
through ``[server] device_rule`` (default ``norm_clip``; ``fedavg`` under central DP), a round with a site's
update through ``update_rule`` (default ``fedavg``). A rule is accepted under ``[privacy] mode = "central"``
only where it declares central DP, and the round writer refuses a central round whose result has no noise
record. Where ``max_update_norm`` is unset, ``max_update_rms`` bounds every update.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedmvp_formats.privacy import PrivacyRecord

from fedmvp.federated.aggregate import Aggregate, Update, apply_updates
from fedmvp.federated.replies import bound_update
from fedmvp.federated.round_writer import RoundFailed, RoundWriter
from fedmvp.federated.update_rules import (UPDATE_RULES, declares_central_dp, register_update_rule, rule_name,
                                           unknown_rule_problem)
from fedmvp.presets.server import ServerSpec

CENTRAL = PrivacyRecord(mode="central", clip_norm=1.0, noise_multiplier=1.0)
LOCAL = PrivacyRecord(mode="local", clip_norm=1.0, noise_multiplier=1.0)
EDGE, SITE = "edge", "site"


def _round(attack: float = -20.0, honest: int = 5):
    """theta and ``honest`` near-equal LoRA deltas plus one ``attack`` times an honest delta (last)."""
    rng = np.random.default_rng(3)
    theta = {"lora.a": rng.normal(size=16).astype(np.float32)}
    direction = rng.normal(scale=0.1, size=16)
    deltas = [direction + rng.normal(scale=0.01, size=16) for _ in range(honest)]
    deltas.append(attack * deltas[0])
    return theta, [Update({"lora.a": (theta["lora.a"] + d).astype(np.float32)}, 10) for d in deltas], direction


@pytest.mark.parametrize("server, privacy, roles, expected", [
    (ServerSpec(), None, [EDGE, EDGE], "norm_clip"),  # devices: robust by default
    (ServerSpec(), None, [SITE, SITE], "fedavg"),  # sites: FedAvg, the paper's rule
    (ServerSpec(), None, [SITE, EDGE], "fedavg"),  # a round with a site's update is a site round
    (ServerSpec(), CENTRAL, [EDGE], "fedavg"),  # central DP: its clip bounds each update
    (ServerSpec(), LOCAL, [EDGE], "norm_clip"),  # local DP: any rule is post-processing
    (ServerSpec(device_rule="fedavg"), None, [EDGE], "fedavg"),
    (ServerSpec(device_rule="median"), None, [EDGE], "median"),
    (ServerSpec(device_rule="median"), None, [SITE], "fedavg"),
    (ServerSpec(update_rule="multi_krum"), None, [EDGE], "multi_krum"),  # one key set: every round follows it
    (ServerSpec(update_rule="multi_krum", device_rule="trimmed_mean"), None, [EDGE], "trimmed_mean"),
    (ServerSpec(update_rule="multi_krum"), None, [SITE], "multi_krum"),
])
def test_the_rule_of_a_round_follows_its_senders(server, privacy, roles, expected):
    assert rule_name(server, privacy, roles) == expected


def test_a_device_round_under_the_default_clips_the_attacker_and_a_site_round_does_not():
    theta, updates, direction = _round()
    devices = RoundWriter(None, ServerSpec())
    step = devices.apply("round 1", theta, updates, [(i, EDGE) for i in range(len(updates))])
    assert devices.applied == "norm_clip" and [e["node"] for e in devices.screened(step)] == [5]
    moved = step.tensors["lora.a"].astype(np.float64) - theta["lora.a"]
    assert float(np.dot(moved, direction)) > 0  # the honest direction survives the -20x flip
    sites = RoundWriter(None, ServerSpec())
    plain = sites.apply("round 1", theta, updates, [(i, SITE) for i in range(len(updates))])
    assert sites.applied == "fedavg" and sites.screened(plain) is None
    expected = apply_updates(theta, updates).tensors["lora.a"]
    assert np.array_equal(plain.tensors["lora.a"], expected)
    assert float(np.dot(plain.tensors["lora.a"].astype(np.float64) - theta["lora.a"], direction)) < 0  # reversed


def test_central_dp_takes_only_rules_that_declare_it():
    assert declares_central_dp("fedavg")
    assert not any(declares_central_dp(n) for n in ("norm_clip", "trimmed_mean", "median", "multi_krum"))
    RoundWriter(None, ServerSpec(), CENTRAL)  # the default device rule falls back to fedavg: accepted
    with pytest.raises(RoundFailed, match=r"^\[server\] device_rule = 'norm_clip' with \[privacy\] mode = 'central'"):
        RoundWriter(None, ServerSpec(device_rule="norm_clip"), CENTRAL)
    with pytest.raises(RoundFailed, match=r"^\[server\] update_rule = 'median' with \[privacy\] mode = 'central'"):
        RoundWriter(None, ServerSpec(update_rule="median"), CENTRAL)
    RoundWriter(None, ServerSpec(device_rule="median"), LOCAL)


def _noiseless(theta, updates, *, server_lr, exponent, privacy) -> Aggregate:
    """Declares central DP but returns the plain mean and no noise record: what the writer must refuse."""
    out = apply_updates(theta, updates, server_lr=server_lr, exponent=exponent, privacy=None)
    return Aggregate(out.tensors, out.weights, privacy=None, clipped=[None] * len(updates))


_noiseless.implements_central_dp = True  # type: ignore[attr-defined]


def _undeclared(theta, updates, *, server_lr, exponent, privacy) -> Aggregate:
    return apply_updates(theta, updates, server_lr=server_lr, exponent=exponent, privacy=privacy)


def test_a_registered_rule_says_whether_it_implements_central_dp_and_the_writer_checks_its_noise():
    register_update_rule("test-noiseless", _noiseless)
    register_update_rule("test-undeclared", _undeclared)
    assert declares_central_dp("test-noiseless") and not declares_central_dp("test-undeclared")
    with pytest.raises(RoundFailed, match="'test-undeclared' does not declare central DP"):
        RoundWriter(None, ServerSpec(update_rule="test-undeclared"), CENTRAL)
    theta, updates, _ = _round(attack=1.0)
    writer = RoundWriter(None, ServerSpec(update_rule="test-noiseless"), CENTRAL)
    with pytest.raises(RoundFailed, match="update rule test-noiseless returned no central-DP noise record"):
        writer.apply("round 2", theta, updates, [(i, SITE) for i in range(len(updates))])
    fedavg = RoundWriter(None, ServerSpec(), CENTRAL).apply("round 2", theta, updates,
                                                            [(i, EDGE) for i in range(len(updates))])
    assert fedavg.privacy["participants"] == len(updates) and fedavg.privacy["noise_std"] > 0
    UPDATE_RULES.pop("test-noiseless")
    UPDATE_RULES.pop("test-undeclared")


def test_an_unknown_device_rule_is_one_line_naming_the_key():
    assert unknown_rule_problem(ServerSpec(device_rule="krum")).startswith("[server] device_rule 'krum' is not a known")
    with pytest.raises(RoundFailed, match=r"device_rule 'krum' is not a known update rule"):
        RoundWriter(None, ServerSpec(device_rule="krum"))


@pytest.mark.parametrize("rms, scale, kept", [
    (10.0, 5.0, True),  # an honest-sized change: within the default bound
    (10.0, 50.0, False),  # a root mean square change of 50 per value: refused by the default
    (0.01, 0.1, False),  # max_update_rms reaches the bound
    (100.0, 50.0, True),
])
def test_every_update_has_a_norm_bound_by_default(rms, scale, kept):
    reference = {"lora.a": np.zeros((4, 8), np.float32), "lora.b": np.zeros(8, np.float32)}
    update = {k: np.full(v.shape, scale, np.float32) for k, v in reference.items()}
    arrays, reason, _ = bound_update(update, reference, ServerSpec(max_update_rms=rms))
    assert (arrays is not None) is kept
    if not kept:
        bound = rms * math.sqrt(40)
        assert reason == (f"update norm {scale * math.sqrt(40):.4g} exceeds the default bound {bound:.4g} "
                          f"(max_update_rms {rms:g} x sqrt(40 values))")
    explicit, why, _ = bound_update(update, reference, ServerSpec(max_update_rms=rms, max_update_norm=1e9))
    assert explicit is not None and why is None  # max_update_norm, where set, is the bound
