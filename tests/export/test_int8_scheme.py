"""Which int8 scheme ships (export/int8_scheme.py): auto plans both and ships the faster; no real calibration
images make auto dynamic with one warning line; a scheme asked by name is planned alone."""

from __future__ import annotations

import numpy as np
import pytest
from test_int8_plan import IMAGES, SCHEME_OPS, labelled, matmuls_as_matmul, mlp, ops, run, runner

from export import int8_scheme
from export.errors import ExportError
from export.int8_scheme import int8_scheme_for, plan_scheme, time_models


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    return np.random.default_rng(7).normal(0, 1, (IMAGES, 32)).astype(np.float32)


@pytest.mark.parametrize(("timings", "shipped"), [
    ({"dynamic": 1.0, "static": 2.0}, "dynamic"),
    ({"dynamic": 2.0, "static": 1.0}, "static"),
])
def test_auto_ships_the_scheme_that_was_faster_here(images, monkeypatch, timings, shipped):
    """Both schemes are planned under the same bound; the timing decides, and the manifest's plan says so."""
    monkeypatch.setattr(int8_scheme, "time_models", lambda models, pixels: {k: timings[k] for k in models})
    proto = matmuls_as_matmul(mlp(1, 0.0))
    reference = run(proto, images)
    target = labelled(images, reference)
    target.max_drop_points = 2.0
    model, plan = plan_scheme(proto, [], reference, runner(images), 0.99, images, "auto", accuracy=target)
    assert plan.scheme == shipped and ops(model).get(SCHEME_OPS[shipped][1], 0) == len(plan.quantized)
    other = "static" if shipped == "dynamic" else "dynamic"
    assert SCHEME_OPS[other][0] not in ops(model)
    choice = plan.scheme_choice
    assert choice["asked"] == "auto" and shipped in choice["why"]
    assert {k: v["ms_per_image_b8"] for k, v in choice["candidates"].items()} == timings
    for figures in choice["candidates"].values():  # each held the bound on its own
        assert figures["drop_points"] <= 2.0 and figures["kept_fp32"] + figures["quantized"] == 3


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_a_scheme_asked_by_name_is_planned_alone(images, monkeypatch, scheme):
    monkeypatch.setattr(int8_scheme, "time_models", lambda *a: pytest.fail("a named scheme is not timed"))
    proto = matmuls_as_matmul(mlp(1, 100.0))
    model, plan = plan_scheme(proto, [], run(proto, images), runner(images), 0.99, images, scheme)
    assert plan.scheme == scheme and plan.scheme_choice == {**plan.scheme_choice, "asked": scheme,
                                                            "why": "asked by name"}
    assert list(plan.scheme_choice["candidates"]) == [scheme] and ops(model)[SCHEME_OPS[scheme][1]] == 3


def test_time_models_gives_each_model_its_ms_per_image(images):
    proto = matmuls_as_matmul(mlp(1, 1.0))
    found = time_models({"a": proto, "b": proto}, images[:8], repeats=2)
    assert set(found) == {"a", "b"} and all(0 < ms < 1000 for ms in found.values())


@pytest.mark.parametrize(("asked", "real", "planned", "warned"), [
    ("auto", 16, "auto", None),
    ("auto", 0, "dynamic", "int8: dynamic quantisation (auto): no real calibration images"),
    ("static", 0, "static", "int8: static quantisation as asked, its activation ranges calibrated on generated"),
    ("dynamic", 0, "dynamic", None),
    ("static", 3, "static", None),
])
def test_without_real_calibration_images_auto_is_dynamic_with_one_line(asked, real, planned, warned):
    scheme, why = int8_scheme_for(asked, real)
    assert scheme == planned and (why is None if warned is None else why.startswith(warned))
    assert why is None or "\n" not in why


def test_an_unknown_scheme_is_one_error_line():
    with pytest.raises(ExportError, match="--int8-scheme 'blockwise': choose one of auto, dynamic, static"):
        int8_scheme_for("blockwise", 5)
