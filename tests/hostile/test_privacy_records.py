"""Hostile [privacy] input (docs/howto/privacy.md): a preset's absurd key is one line naming it, exit 2,
no run directory; a round's state.json ``privacy`` record with a value that is no usable number is one
line in `fedmvp evaluate` and `fedmvp-export` (read before anything is built or written), and one of an
older fedmvp without ``sampling_rate`` or ``noise_multiplier`` is charged q = 1 at the run's z."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.federated.conftest import PRESET
from tests.hostile.disk import Hostile, assert_one_line_error, run, tree_digest
from tests.hostile.test_training_core import test_hostile_input_is_one_line_and_changes_nothing as one_row

BAD_KEYS = {"z-huge": "noise_multiplier = 1e300", "z-negative": "noise_multiplier = -1.0",
            "z-nan": "noise_multiplier = nan", "z-tiny": "noise_multiplier = 1e-300",
            "clip-huge": "clip_norm = 1e300", "delta-tiny": "target_delta = 1e-300", "mode-typo": 'mode = "centrale"',
            "max-epsilon-inf": "max_epsilon = inf"}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Bad [privacy] presets, and prepared runs (never trained) whose round 2 records a privacy record."""
    import torch

    from fedmvp.federated.prepare import prepare_run
    from fedmvp.runs import RunDir
    from fedmvp.synthetic.writer import write_world

    base = tmp_path_factory.mktemp("hostile-privacy")
    world = write_world(base / "world", counts={"train": 2, "test": 2}, domains=["photo", "painting"])
    good = PRESET.format(root=world, sigma=1000.0) + "\n[privacy]\nnoise_multiplier = 1.5\n"
    (base / "good.toml").write_text(good)
    for name, line in BAD_KEYS.items():
        key = line.split(" = ")[0]
        text = good.replace("noise_multiplier = 1.5", line) if key == "noise_multiplier" else good + line + "\n"
        (base / f"{name}.toml").write_text(text)
    records = {"privbad": {"sampling_rate": "x", "noise_multiplier": 1.5, "epsilon": 1.0},
               "privnan": {"sampling_rate": 1.0, "noise_multiplier": "nan"},
               "privold": {"epsilon": 3.0}}  # an older record: neither sampling_rate nor noise_multiplier
    for name, record in records.items():
        path = base / name
        prepare_run(str(base / "good.toml"), str(path), None, False, "cpu")
        method = RunDir(path).read_config()["method"]
        for number in (1, 2):
            RunDir(path).save_checkpoint(number, {"promptformer.w": torch.zeros(2)}, {
                "method": method, "metrics": {"hm": 0.5, "local": 0.5, "base": 0.5, "new": 0.5},
                **({"privacy": record} if number == 2 else {})})
        RunDir(path).write_zero_shot({"hm": 0.4, "local": 0.4, "base": 0.4, "new": 0.4})
    return base


ROWS = [Hostile(f"train-{name}", ["train", "--config", f"{name}.toml", "--run-dir", "r"], 2,
                f"[privacy]: {line.split(' = ')[0]} must be") for name, line in BAD_KEYS.items()] + [
    Hostile("evaluate-sampling-rate-text", ["evaluate", "--run", "privbad", "--round", "2"], 2,
            "round-0002/state.json: privacy sampling_rate 'x' is not a usable number", ["privbad"]),
    Hostile("evaluate-noise-multiplier-text", ["evaluate", "--run", "privnan", "--round", "2"], 2,
            "privacy noise_multiplier 'nan' is not a usable number", ["privnan"]),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_hostile_privacy_input_is_one_line_and_writes_nothing(root, row):
    one_row(root, row)  # the training core's table check: one line, exit 2, nothing changed, no run dir


def test_export_refuses_a_bad_privacy_record_before_writing(root):
    before = tree_digest(root / "privbad")
    done = run("fedmvp-export", ["--run", "privbad", "--round", "2", "--out", "bundle"], cwd=root)
    assert_one_line_error(done, 2, "privacy sampling_rate 'x' is not a usable number")
    assert tree_digest(root / "privbad") == before and not (root / "bundle").exists()


def test_an_older_record_without_sampling_rate_is_charged_q_1_at_the_runs_z(root):
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    done = run("fedmvp", ["evaluate", "--run", "privold", "--round", "2", "--json"], cwd=root)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout + done.stderr
    privacy = json.loads(done.stdout)["privacy"]
    accountant = RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(1.5))
    assert privacy["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    assert (privacy["sampling_rate"], privacy["dp_rounds"]) == (1.0, 1)
    shown = run("fedmvp", ["evaluate", "--run", "privold", "--round", "2"], cwd=root)
    assert shown.returncode == 0 and "privacy: epsilon" in shown.stdout, shown.stdout + shown.stderr
