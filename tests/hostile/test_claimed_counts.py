"""`[server] count_cap`: an update's example count weighs at most count_cap times the round's median, whatever
it claims (fedmvp/federated/count_cap.py); the round's state.json records the cap and whom it capped."""

from __future__ import annotations

import numpy as np
import pytest

from fedmvp.federated.aggregate import Update
from fedmvp.federated.count_cap import cap_counts
from fedmvp.federated.ingest import ingest
from fedmvp.runs import RunDir
from tests.federated.test_ingest import base_run, configure, good_update, lora_of, run  # noqa: F401


def _updates(counts: list[int]) -> list[Update]:
    return [Update({"lora.x": np.zeros(2, np.float32)}, n) for n in counts]


@pytest.mark.parametrize("counts, factor, weighed, cap", [
    ([10] * 9 + [10000], 3.0, [10] * 9 + [30], 30.0),  # one claims the most: 3/12 of the round, not 10000/10090
    ([10, 20, 30], 3.0, [10, 20, 30], 60.0),  # nobody beyond it: FedAvg's weights as they were
    ([10, 1000], 3.0, [10, 1000], 1515.0),  # two updates: the median is their mean
    ([5, 5, 100], 1.0, [5, 5, 5], 5.0),
    ([10] * 9 + [10000], 0.0, [10] * 9 + [10000], None),  # 0: no cap
    ([10000], 3.0, [10000], None),  # one update: nothing to compare with
])
def test_counts_are_capped_at_a_multiple_of_the_median(counts, factor, weighed, cap):
    capped, record = cap_counts(_updates(counts), factor, [(f"n{i}", "edge") for i in range(len(counts))])
    assert [u.examples for u in capped] == weighed
    assert (record or {}).get("cap") == cap
    if record is not None:
        assert [c["node"] for c in record["capped"]] == [f"n{i}" for i, (a, b) in enumerate(zip(counts, weighed))
                                                          if a != b]


def _attack(run, tmp_path, count_cap):
    """Nine honest files (10 examples, one direction) and one sign-flipped delta just under norm_clip's bound
    claiming edge_max_examples (100): the round's step, and round 3's state.json."""
    configure(run, {"max_staleness": 0, "edge_max_examples": 100, "update_rule": "norm_clip", "count_cap": count_cap})
    lora = lora_of(run)
    rng = np.random.default_rng(0)
    direction = {k: rng.normal(scale=0.01, size=v.shape) for k, v in lora.items()}
    files = []
    for i in range(10):
        if i < 9:
            delta = {k: d + rng.normal(scale=0.001, size=d.shape) for k, d in direction.items()}
        else:  # norm_clip's bound is 2 x the median norm: 1.9 x passes unclipped
            delta = {k: -1.9 * d for k, d in direction.items()}
        moved = {k: (lora[k] + delta[k]).astype(np.float32) for k in lora}
        files.append(good_update(tmp_path / f"u{i}.st", lora, 0.0, 100 if i == 9 else 10, 1.0, moved=moved))
    result = ingest(run, files)
    assert result.round == 3 and len(result.accepted) == 10, [v.reason for v in result.rejected]
    after = lora_of(run, 3)
    step = np.concatenate([(after[k].astype(np.float64) - lora[k]).ravel() for k in sorted(lora)])
    honest = np.concatenate([direction[k].ravel() for k in sorted(lora)])
    return float(step @ honest / np.linalg.norm(step) / np.linalg.norm(honest)), RunDir(run).round_state(3)


def test_a_claimed_count_cannot_reverse_the_round(run, tmp_path):
    cosine, state = _attack(run, tmp_path, 3.0)
    assert cosine > 0.9, cosine  # 90 honest against 30 (capped) x 1.9: the honest direction
    assert state["count_cap"]["cap"] == 30.0 and state["count_cap"]["median"] == 10.0
    assert [c["node"] for c in state["count_cap"]["capped"]] == [str(tmp_path / "u9.st")]
    assert state["ingest_rules"]["count_cap"] == 3.0


def test_without_the_cap_the_same_claim_reverses_it(run, tmp_path):
    cosine, state = _attack(run, tmp_path, 0.0)
    assert cosine < -0.9, cosine  # 90 honest against 100 x 1.9: the round steps backwards
    assert "count_cap" not in state and state["ingest_rules"]["count_cap"] == 0.0
