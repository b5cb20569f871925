"""What the project writes as JSON parses with a strict parser: a number that is not finite becomes null."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedmvp_formats import strict_json


@pytest.mark.parametrize("value, written", [
    (float("nan"), None), (float("inf"), None), (-math.inf, None), (np.float32("nan"), None), (np.float64(2.5), 2.5),
    (1.5, 1.5), (3, 3), (True, True), ("NaN", "NaN"), (None, None),
    ({"a": [1.0, float("nan"), {"b": math.inf}]}, {"a": [1.0, None, {"b": None}]}), ((1.0, math.nan), [1.0, None]),
])
def test_non_finite_numbers_are_written_as_null(value, written):
    assert strict_json.loads(strict_json.dumps(value)) == written


def test_the_strict_reader_refuses_what_python_writes_by_default():
    import json

    for token in ("NaN", "Infinity", "-Infinity"):
        with pytest.raises(ValueError, match=f"{token} is not JSON"):
            strict_json.loads(json.dumps({"x": float(token.replace("Infinity", "inf"))}))


def test_a_runs_records_and_rows_parse_strictly(tmp_path):
    """state.json (atomic.write_json), metrics.jsonl and metrics.csv of a row whose loss parts nobody measured
    (a buffered version's train_ce): null and an empty cell, not NaN."""
    from fedmvp import atomic
    from fedmvp.run_metrics import append_metrics
    from fedmvp.runs import RunDir

    row = {"round": 1, "train_loss": 0.5, "train_ce": float("nan"), "train_consistency": float("inf")}
    atomic.write_json(tmp_path / "state.json", {"metrics": row})
    assert strict_json.loads((tmp_path / "state.json").read_text())["metrics"]["train_ce"] is None
    run = RunDir(tmp_path)
    append_metrics(run, row)
    line = (tmp_path / run.METRICS).read_text().splitlines()[0]
    assert strict_json.loads(line) == {**row, "train_ce": None, "train_consistency": None}
    csv = (tmp_path / run.METRICS_CSV).read_text()
    assert "nan" not in csv.lower() and "inf" not in csv.lower() and csv.splitlines()[1].startswith("1,0.5,,")
