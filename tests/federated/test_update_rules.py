"""A new update rule is one function and one registration (docs/architecture.md, "How to add ...").

The toy rule here lives outside the package, is registered from this file and selected by the preset's
``[server] update_rule``; a real `fedmvp train` (Flower's simulation engine, the tiny CLIP, one round)
must then write its round with exactly what the toy rule computed, and record the toy rule's weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedmvp.federated.aggregate import Aggregate, Update
from fedmvp.federated.update_rules import UPDATE_RULES, register_update_rule, update_rule
from tests.deadlines import scaled

TOY = "toy-max"
TOY_WEIGHT = 0.125  # what the toy rule says each update weighed: no FedAvg weight of two sites is this


def toy_max(theta, updates: list[Update], *, server_lr: float, exponent: float, privacy) -> Aggregate:
    """Each tensor: the elementwise largest value any update sent (never FedAvg's mean of two different
    replies). The inputs are kept in FEDMVP_TOY_RULE (a folder), so the test can compute the result."""
    keys = sorted({k for u in updates for k in u.arrays})
    tensors = {k: np.max(np.stack([u.arrays[k] for u in updates if k in u.arrays]), axis=0).astype(np.float32)
               for k in keys}
    folder = os.environ.get("FEDMVP_TOY_RULE")
    if folder:
        calls = len(list(Path(folder).glob("call-*")))
        target = Path(folder) / f"call-{calls}"
        target.mkdir()
        for i, update in enumerate(updates):
            np.savez(target / f"update-{i}.npz", **update.arrays)
    return Aggregate(tensors, [{"staleness": u.staleness, "s": 1.0, "weight": TOY_WEIGHT} for u in updates],
                     clipped=[None] * len(updates))


def register() -> None:
    """What a project that adds a rule does once, before the server starts (here: in the test's process)."""
    register_update_rule(TOY, toy_max)


def test_a_rule_is_found_by_name_and_an_unknown_name_is_one_line():
    register()
    assert update_rule(TOY) is toy_max and update_rule("fedavg") is UPDATE_RULES["fedavg"]
    register()  # the same rule again: nothing changes
    with pytest.raises(ValueError, match="already registered"):
        register_update_rule(TOY, lambda *a, **k: None)
    with pytest.raises(ValueError, match=r"update_rule 'nope' is not a known update rule \(known: .*fedavg"):
        update_rule("nope")


@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
@pytest.mark.timeout(400)
def test_a_toy_rule_registered_outside_the_package_writes_the_round(tmp_path, small_world):
    from safetensors.numpy import load_file

    from tests.federated.conftest import write_preset

    preset = write_preset(tmp_path, small_world)
    preset.write_text(preset.read_text().replace("rounds = 3", "rounds = 1") + f'\n[server]\nupdate_rule = "{TOY}"\n')
    run_dir, inputs = tmp_path / "toy", tmp_path / "inputs"
    inputs.mkdir()
    script = ("from fedmvp.federated.prepare import prepare_run\nfrom fedmvp.federated.simulation import simulate\n"
              "from tests.federated.test_update_rules import register\nregister()\n"
              f"simulate(prepare_run({str(preset)!r}, {str(run_dir)!r}, None, False, 'cpu'), progress=False)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True, timeout=scaled(380), env={**os.environ, "FEDMVP_TOY_RULE": str(inputs)})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert json.loads((run_dir / "config.json").read_text())["server"]["update_rule"] == TOY
    calls = sorted(inputs.glob("call-*"))
    assert len(calls) == 1  # one round, one call of the rule
    sent = [dict(np.load(path)) for path in sorted(calls[0].glob("update-*.npz"))]
    assert len(sent) == 2  # both sites' replies
    written = load_file(str(run_dir / "round-0001" / "global.safetensors"))
    for key in sorted({k for update in sent for k in update}):
        values = [update[key] for update in sent if key in update]
        assert np.array_equal(written[key], np.max(np.stack(values), axis=0)), key
        if len(values) == 2 and not np.array_equal(values[0], values[1]):
            assert not np.array_equal(written[key], ((values[0] + values[1]) / 2).astype(np.float32))  # no mean
    state = json.loads((run_dir / "round-0001" / "state.json").read_text())
    assert [r["weight"] for r in state["replies"]] == [TOY_WEIGHT, TOY_WEIGHT]


def test_an_unknown_rule_stops_the_server_before_any_round():
    from fedmvp.federated.round_writer import RoundFailed, RoundWriter
    from fedmvp.presets.server import ServerSpec

    with pytest.raises(RoundFailed, match="update_rule 'nope' is not a known update rule"):
        RoundWriter(None, ServerSpec(update_rule="nope"))
