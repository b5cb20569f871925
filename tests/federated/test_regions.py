"""Regions feeding one central run (docs/howto/regions.md): `fedmvp region-start`, `fedmvp region-update`.

The central run is tests/run_fixtures.py's (rounds 1 and 2 that differ, tiny CLIP, LoRA rank 4). Regions are
trained by `fedmvp ingest` of device update files (the cheapest real run kind; the command only reads a run's
checkpoints). Device files are written by edge_client.update.write_update, as in test_ingest.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from fedmvp.federated.regions import REGION_RECORD, region_start, region_update
from fedmvp.runs import RunDir, RunError
from tests.deadlines import scaled
from tests.federated.processes import ENV, FEDMVP
from tests.federated.test_ingest import RUN_ID, configure, good_update, lora_of, round_promptformer

SERVER = {"edge_max_examples": 100}


@pytest.fixture(scope="module")
def central_base(tmp_path_factory) -> Path:
    from fedmvp.attributes.sentences import SentenceStyle
    from fedmvp.run_classes import RunClass, write_classes
    from tests.run_fixtures import write_run

    root = tmp_path_factory.mktemp("regions")
    write_run(root / "central", root / "preset.toml", "", "regiontest", moved=True)
    write_classes(root / "central", [RunClass("x", ("a photo",), SentenceStyle(prefix="", suffix=""))])
    configure(root / "central", SERVER)
    return root / "central"


@pytest.fixture
def central(central_base, tmp_path) -> Path:
    shutil.copytree(central_base, tmp_path / "central")
    return tmp_path / "central"


def device_file(region: Path, folder: Path, name: str, shift: float, examples: int, loss: float = 1.0) -> Path:
    """A device's update file trained on the region's last round (its run id, round and PromptFormer)."""
    run = RunDir(region)
    last = run.last_round()
    return good_update(folder / f"{name}.st", lora_of(region, last), shift, examples, loss, round_number=last,
                       run_id=run.read_config()["run_id"], promptformer=round_promptformer(region, last),
                       classes=_classes(region))


def _classes(run: Path) -> str:
    from fedmvp.run_classes import class_set

    return class_set(RunDir(run).class_set()).digest


def cli(*args: str) -> dict:
    """One real `fedmvp` process with --json; its JSON."""
    done = subprocess.run([*FEDMVP, *args, "--json"], env=ENV, capture_output=True, text=True, timeout=scaled(120))
    assert done.returncode == 0, f"{args}\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout)


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_two_regions_enter_the_central_run_as_the_weighted_delta_rule(central, tmp_path):
    devices = tmp_path / "devices"
    devices.mkdir()
    a, b = tmp_path / "region-a", tmp_path / "region-b"
    assert cli("region-start", "--central", str(central), "--round", "1", "--out", str(a))["central_round"] == 1
    assert cli("region-start", "--central", str(central), "--out", str(b))["central_round"] == 2
    # region A: two rounds (10 + 30 examples, then 20); region B: one round (25)
    cli("ingest", "--run", str(a), str(device_file(a, devices, "a1", 0.01, 10, 1.5)),
        str(device_file(a, devices, "a2", -0.02, 30, 0.5)))
    cli("ingest", "--run", str(a), str(device_file(a, devices, "a3", 0.03, 20, 1.0)))
    cli("ingest", "--run", str(b), str(device_file(b, devices, "b1", -0.01, 25, 2.0)))
    assert RunDir(a).rounds() == [1, 2, 3] and RunDir(b).rounds() == [2, 3]

    made_a = cli("region-update", "--run", str(a), "--out", str(tmp_path / "a.st"))
    made_b = cli("region-update", "--run", str(b), "--out", str(tmp_path / "b.st"))
    assert (made_a["examples"], made_a["rounds"], made_a["central_round"]) == (60, [2, 3], 1)
    assert (made_b["examples"], made_b["rounds"], made_b["central_round"]) == (25, [3], 2)
    assert made_a["mean_loss"] == pytest.approx((10 * 1.5 + 30 * 0.5 + 20 * 1.0) / 60)

    report = cli("ingest", "--run", str(central), str(tmp_path / "a.st"), str(tmp_path / "b.st"))
    assert report["round"] == 3 and report["rejected"] == [], report
    assert sorted((r["num_examples"], r["staleness"]) for r in report["accepted"]) == [(25, 0), (60, 1)]

    # theta_2 + sum_i n_i s(t_i) (L_i - base_i) / sum_i n_i, s(t) = (1 + t)^-0.5 (docs/method.md §6)
    theta, after = lora_of(central, 2), lora_of(central, 3)
    delta_a = {k: lora_of(a, 3)[k].astype(np.float64) - lora_of(central, 1)[k] for k in theta}
    delta_b = {k: lora_of(b, 3)[k].astype(np.float64) - lora_of(central, 2)[k] for k in theta}
    for name in theta:
        step = (60 * 2 ** -0.5 * delta_a[name] + 25 * delta_b[name]) / 85
        np.testing.assert_allclose(after[name], theta[name] + step, rtol=0, atol=1e-5)
        assert np.abs(step).max() > 1e-3  # the regions moved it
    assert json.loads((a / REGION_RECORD).read_text())["central_run_id"] == RUN_ID


# ---- refusals, in process ------------------------------------------------------------------------------
def test_a_region_has_its_own_run_id_and_the_central_round_bit_for_bit(central, tmp_path):
    link = region_start(central, tmp_path / "r", 2)
    region = RunDir(tmp_path / "r")
    assert region.rounds() == [2] and region.read_config()["run_id"] not in (None, RUN_ID)
    assert (region.round_weights_path(2).read_bytes() == RunDir(central).round_weights_path(2).read_bytes())
    assert (link.central_run_id, link.edge_max_examples) == (RUN_ID, 100)
    central_rounds = RunDir(central).read_config()["rounds"]  # default budget: the central run's rounds
    assert (link.rounds, region.read_config()["rounds"]) == (central_rounds, 2 + central_rounds)
    assert region_start(central, tmp_path / "r5", 1, rounds=5).rounds == 5  # a served region's own budget
    assert RunDir(tmp_path / "r5").read_config()["rounds"] == 6  # `fedmvp serve` writes rounds 2..6
    with pytest.raises(RunError, match="at least 1 round after round 2, not 0"):
        region_start(central, tmp_path / "r0", rounds=0)
    with pytest.raises(RunError, match="exists"):
        region_start(central, tmp_path / "r")
    with pytest.raises(RunError, match="no complete round 7"):
        region_start(central, tmp_path / "s", 7)


def test_region_update_refuses_what_ingest_would_not_take(central, tmp_path):
    region = tmp_path / "r"
    region_start(central, region)
    with pytest.raises(RunError, match="no round after round 2"):
        region_update(region, tmp_path / "u.st")
    from fedmvp.federated.ingest import ingest

    too_many = ingest(region, [device_file(region, tmp_path, "d", 0.01, 101)])  # the region's bound: the central's
    assert too_many.round is None and "exceeds edge_max_examples (100)" in too_many.files[0].reason
    ingest(region, [device_file(region, tmp_path, "d1", 0.01, 60)])
    ingest(region, [device_file(region, tmp_path, "d2", 0.01, 50)])
    with pytest.raises(RunError, match=r"110 examples since round 2, more than the central run's \[server\] "
                                       r"edge_max_examples \(100\)"):
        region_update(region, tmp_path / "u.st")
    assert not (tmp_path / "u.st").exists()
    configure(central, {"edge_max_examples": 110})  # raised in the central run, the region started again
    again = tmp_path / "again"
    region_start(central, again)
    for i, n in enumerate((60, 50)):
        ingest(again, [device_file(again, tmp_path, f"e{i}", 0.01, n)])
    assert region_update(again, tmp_path / "u.st").examples == 110
    from fedmvp.federated.ingest import ingest as central_ingest

    assert central_ingest(central, [tmp_path / "u.st"]).round == 3

    shutil.copy(RunDir(central).round_weights_path(1), RunDir(again).round_weights_path(2))  # its base changed
    with pytest.raises(RunError, match="not central round 2's checkpoint any more"):
        region_update(again, tmp_path / "v.st")


def test_a_region_that_moved_its_promptformer_is_refused(central, tmp_path):
    import torch

    region = tmp_path / "r"
    region_start(central, region)
    run = RunDir(region)
    checkpoint = run.load_checkpoint(2)
    tensors = {k: v + 0.1 if k.startswith("promptformer.") else v for k, v in checkpoint.tensors.items()}
    run.save_checkpoint(3, {k: torch.as_tensor(v) for k, v in tensors.items()},
                        {**checkpoint.state, "replies": [{"examples": 5}], "metrics": {"train_loss": 1.0}})
    with pytest.raises(RunError, match="PromptFormer is not round 2's"):
        region_update(region, tmp_path / "u.st")


def test_the_commands_fail_in_one_line(central, tmp_path):
    from fedmvp_apps.cli import main

    result = CliRunner().invoke(main, ["region-update", "--run", str(central), "--out", str(tmp_path / "u.st")])
    assert result.exit_code == 2 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert f"{central}/{REGION_RECORD}: missing: not a region" in result.stderr
    result = CliRunner().invoke(main, ["region-start", "--central", str(tmp_path / "no"), "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and "not a fedmvp run" in result.stderr
