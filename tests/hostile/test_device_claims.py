"""What a device says about itself, tried as an outsider would through `fedmvp ingest`, under the defaults.

Rows (docs/howto/robust.md "Devices: a robust default", docs/howto/privacy.md "One device, one participant"):
- one device of ten sends a sign-flipped delta and claims the most examples the run accepts, with no
  ``[server]`` rule set: the devices' default rule and the count cap keep the round's step honest;
- a LoRA moved by 50 in every value (finite, within the value bound) is refused by the default norm bound;
- under ``[privacy]``: one device's files in one release are one participant, and its newest re-saved
  under a fresh device id is still one training (no older file of the device gets in beside it); a rule registered without central DP, or one that says
  it has it but adds no noise, writes nothing;
- a device id is no credential: an outsider who names a victim's id with a later ``created`` displaces
  the victim's file from that release (refused with a line, ingestible later), never adds a participant.
The run is tests/run_fixtures.py's (rounds 1 and 2, tiny CLIP); ingest runs in process.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedmvp.federated.aggregate import apply_updates
from fedmvp.federated.ingest import ingest
from fedmvp.federated.update_rules import UPDATE_RULES, register_update_rule
from fedmvp.runs import RunDir, RunError
from fedmvp_formats.privacy import PrivacyRecord
from tests.federated.test_ingest import base_run, configure, good_update, lora_of, run  # noqa: F401
from tests.hostile.test_replayed_updates import resaved

VICTIM = "c3" * 16


def _private(run, **settings) -> None:
    record = PrivacyRecord(**{"clip_norm": 0.05, "noise_multiplier": 1.0, "max_epsilon": None, **settings})
    RunDir(run).write_config({**RunDir(run).read_config(), "privacy": record.record()})


def test_a_claimed_count_with_a_flipped_delta_cannot_reverse_a_round_under_the_defaults(run, tmp_path):
    configure(run, {"max_staleness": 0, "edge_max_examples": 100})  # no rule set: the devices' default
    lora = lora_of(run)
    rng = np.random.default_rng(1)
    direction = {k: rng.normal(scale=0.01, size=v.shape) for k, v in lora.items()}
    files = []
    for i in range(10):
        delta = {k: (-1.9 if i == 9 else 1.0) * d + (0 if i == 9 else rng.normal(scale=0.001, size=d.shape))
                 for k, d in direction.items()}
        files.append(good_update(tmp_path / f"u{i}.st", lora, 0.0, 100 if i == 9 else 10, 1.0,
                                 moved={k: (lora[k] + delta[k]).astype(np.float32) for k in lora}))
    assert ingest(run, files).round == 3
    after = lora_of(run, 3)
    step = np.concatenate([(after[k].astype(np.float64) - lora[k]).ravel() for k in sorted(lora)])
    honest = np.concatenate([direction[k].ravel() for k in sorted(lora)])
    assert float(step @ honest / np.linalg.norm(step) / np.linalg.norm(honest)) > 0.9
    state = RunDir(run).round_state(3)
    assert "screened" in state and state["count_cap"]["capped"][0]["node"] == str(files[9])


def test_a_lora_moved_by_fifty_everywhere_is_refused_by_the_default_bound(run, tmp_path):
    lora = lora_of(run)
    absurd = good_update(tmp_path / "absurd.st", lora, 0.0, 10, 1.0, moved={k: v + 50.0 for k, v in lora.items()})
    result = ingest(run, [absurd])
    assert result.round is None and "exceeds the default bound" in result.rejected[0].reason
    assert "max_update_rms 10" in result.rejected[0].reason


def test_one_devices_files_in_a_private_release_are_one_participant(run, tmp_path):
    _private(run, mode="central")
    lora = lora_of(run)
    mine = [good_update(tmp_path / f"mine-{i}.st", lora, 0.01 * (i + 1), 10, 1.0, device_id=VICTIM,
                        created=f"2026-01-0{i + 1}T00:00:00Z") for i in range(3)]
    again = resaved(mine[2], tmp_path / "again.st", device_id="d4" * 16, created="2026-02-01T00:00:00Z")
    result = ingest(run, [*mine, again])
    # the device's newest file stands for it; its copy under a fresh id is the same training, and the newer
    # of the two counts: the device's data is in the release once, not its older file beside the copy
    assert [v.file for v in result.accepted] == [str(again)]
    assert RunDir(run).round_state(3)["privacy"]["participants"] == 1
    reasons = {v.file: v.reason for v in result.rejected}
    assert "the same training" in reasons[str(mine[2])]
    assert all("one participant of a release" in reasons[str(p)] for p in mine[:2])


def test_a_device_id_is_no_credential_an_outsider_displaces_not_adds(run, tmp_path):
    _private(run, mode="local")
    lora = lora_of(run)
    victim = good_update(tmp_path / "victim.st", lora, 0.01, 10, 1.0, device_id=VICTIM,
                         created="2026-01-01T00:00:00Z")
    outsider = good_update(tmp_path / "outsider.st", lora, -0.02, 10, 1.0, device_id=VICTIM,
                           created="2099-01-01T00:00:00Z")
    result = ingest(run, [victim, outsider])
    assert [v.file for v in result.accepted] == [str(outsider)] and "into this release too" in result.rejected[0].reason
    configure(run, {"max_staleness": 1, "edge_max_examples": 100})
    _private(run, mode="local")
    assert [v.file for v in ingest(run, [victim]).accepted] == [str(victim)]  # displaced, not lost


def _undeclared(theta, updates, *, server_lr, exponent, privacy):
    """A recipe's rule that ignores [privacy]: plain FedAvg, no clip, no noise, and no declaration."""
    return apply_updates(theta, updates, server_lr=server_lr, exponent=exponent, privacy=None)


def _claims_central(theta, updates, *, server_lr, exponent, privacy):
    """Says it implements central DP, but adds no noise and returns no record."""
    return apply_updates(theta, updates, server_lr=server_lr, exponent=exponent, privacy=None)


_claims_central.implements_central_dp = True  # type: ignore[attr-defined]


@pytest.mark.parametrize("name, rule, says", [
    ("hostile-undeclared", _undeclared, "does not declare central DP"),
    ("hostile-claims-central", _claims_central, "returned no central-DP noise record"),
])
def test_a_rule_without_central_dp_writes_nothing_under_central_privacy(run, tmp_path, name, rule, says):
    register_update_rule(name, rule)
    try:
        configure(run, {"max_staleness": 0, "edge_max_examples": 100, "device_rule": name})
        _private(run, mode="central")
        update = good_update(tmp_path / "u.st", lora_of(run), 0.01, 10, 1.0)
        with pytest.raises(RunError) as err:
            ingest(run, [update])
        assert says in str(err.value) and "\n" not in str(err.value)
        assert RunDir(run).rounds() == [1, 2]
    finally:
        UPDATE_RULES.pop(name)
