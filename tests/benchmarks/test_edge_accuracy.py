"""The edge section's accuracy of `auto` and OpenVINO bf16 on a trained run (benchmarks/edge_accuracy.py):
the keys appear in a --quick run given a run, and the figures are those of the run's labelled test images."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.common import Options

KEYS = ("auto_accuracy_drop_points", "auto_top1_agreement", "openvino_bf16_accuracy_drop_points",
        "openvino_bf16_top1_agreement")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    from tests.export.export_helpers import tiny_run_in

    return tiny_run_in(tmp_path_factory.mktemp("bench-run"))


def test_auto_and_bf16_accuracy_are_measured_on_the_runs_labelled_images(tiny_run, tmp_path):
    from benchmarks.edge_accuracy import accuracy_ratios, labelled_images, trained_runtimes
    from edge_client.bundle import Bundle
    from edge_client.infer import Predictor

    found = trained_runtimes(tiny_run, tmp_path, threads=1, count=256)
    bundle = Bundle.open(tmp_path / "trained-fp32")
    pixels, labels = labelled_images(tiny_run, bundle, 256)
    assert found["images"] == len(labels) > 32 and found["check_images"] == "run-test"
    fp32 = Predictor(bundle, provider="cpu", personalised=False).run(pixels)["logits"]
    assert found["fp32_accuracy"] == round(float(np.mean(fp32.argmax(-1) == labels)), 6)
    auto = found["auto"]
    assert auto["runtime"] in ("ort", "openvino")
    assert "verified on" in auto["line"] or auto["how"] == "only"
    assert auto["drop_points"] == round(100 * (found["fp32_accuracy"] - auto["accuracy"]), 4)
    ratios = accuracy_ratios(found)
    assert set(ratios) == set(KEYS) and ratios["auto_top1_agreement"] == auto["top1_agreement"]
    assert accuracy_ratios(None) == dict.fromkeys(KEYS)  # no trained run: the keys, unmeasured


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_a_quick_edge_run_on_a_trained_run_reports_the_keys(tiny_run):
    from benchmarks import edge

    section = edge.run(Options(quick=True, threads=1, repeats=1, run=tiny_run))
    for key in KEYS[:2] + ("int8_accuracy_drop_points",):
        assert isinstance(section.ratios[key], float), key
    for key in KEYS[2:]:
        assert key in section.ratios
    assert section.config["trained_runtimes"]["images"] > 32
    assert any(g.name.startswith("auto accuracy drop") and g.met is not None for g in section.goals)
    json.dumps(section.to_json())
