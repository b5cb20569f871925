"""The edge table's engine rows and hook points: ratios and goals from rows, the hooks' figures read
whatever shape they come in, and a missing hook module is a note (timings are benchmarks/' business)."""

from __future__ import annotations

import sys
import types

import pytest

from benchmarks import edge_engines, edge_hooks
from benchmarks.common import Section

MS = {("torch_prompted", 1): 200.0, ("ort_fp32", 1): 160.0, ("torchscript", 1): 220.0,
      ("torch_prompted", 8): 150.0, ("ort_fp32", 8): 120.0, ("torchscript", 8): 200.0}


def test_engine_ratios_and_goals_come_from_the_rows():
    checks = {"torchscript": {"check_top1_agreement": 1.0, "check_max_abs_logit_diff": 2e-6}}
    r = edge_engines.engine_ratios(MS, [1, 8], ["torchscript"], checks)
    assert r["torchscript_vs_ort_fp32_b8"] == pytest.approx(0.6)
    assert r["torchscript_time_vs_torch_prompted_b8"] == pytest.approx(200 / 150, rel=1e-3)
    assert r["torchscript_time_vs_torch_prompted_b1"] == pytest.approx(1.1)
    goals = {g.name.split(" (")[0]: g for g in edge_engines.engine_goals(r, [1, 8], "ViT-B-16", ["torchscript"])}
    assert goals["TorchScript inference within 1.2x of PyTorch eager at batch 8 on ViT-B-16"].met is False
    assert goals["TorchScript top-1 equals fp32 ONNX on the check images"].met is True


def test_an_engine_not_measured_keeps_its_ratios_and_goals_as_not_measured():
    r = edge_engines.engine_ratios({("ort_fp32", 8): 120.0}, [1, 8], [], {})
    assert r["torchscript_vs_ort_fp32_b8"] is None and r["torchscript_check_top1_agreement"] is None
    assert all(g.met is None for g in edge_engines.engine_goals(r, [1, 8], "fedmvp-tiny", []))


@pytest.mark.parametrize("result", [  # benchmarks.edge_cpp.cpp_ms_per_image's keys
    {"cpp": {1: 100.0, 8: 80.0}, "ort_fp32": {1: 90.0, 8: 70.0}, "top1": [0, 1, 2, 3]},
])
def test_the_cpp_hook_becomes_a_row_ratios_and_the_agreement_goal(monkeypatch, tmp_path, result):
    seen = {}

    def cpp_ms_per_image(bundle, batch_sizes, repeats):
        seen.update(bundle=bundle, batch_sizes=batch_sizes, repeats=repeats)
        return result

    monkeypatch.setitem(sys.modules, "benchmarks.edge_cpp", types.SimpleNamespace(cpp_ms_per_image=cpp_ms_per_image))
    monkeypatch.setitem(sys.modules, "benchmarks.edge_train_formats", None)  # not this test's hook
    hooks = edge_hooks.measure(tmp_path, tmp_path, "fedmvp-tiny", 4, 1, [1, 8], 3, [0, 1, 2, 0])
    assert seen == {"bundle": tmp_path, "batch_sizes": [1, 8], "repeats": 3}
    section = Section("edge")
    edge_hooks.apply(section, hooks, MS, [1, 8])
    rows = [r for r in section.rows if r["runtime"] == "cpp_libtorch"]
    assert [r["ms_per_image"] for r in rows] == [100.0, 80.0]
    assert section.ratios["cpp_libtorch_vs_ort_fp32_b8"] == pytest.approx(1.5)
    assert section.ratios["cpp_libtorch_check_top1_agreement"] == 0.75  # one image of 4 differs
    goal = next(g for g in section.goals if g.name.startswith("C++ agrees with ORT"))
    assert goal.met is False


def test_the_train_hook_reads_rows_and_a_missing_hook_is_a_note(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "benchmarks.edge_cpp", None)  # import fails: as without the module
    monkeypatch.setitem(sys.modules, "benchmarks.edge_train_formats", None)
    section = Section("edge")
    hooks = {"cpp": None, "train": {"batch": 8, "pt2_ms": 400.0, "torchscript_ms": 480.0, "ratio": 1.2},
             "train_batch": 8, "notes": [], "reference_top1": None}
    hooks["notes"] = edge_hooks.measure(tmp_path, tmp_path, "fedmvp-tiny", 4, 1, [1, 8], 3, None)["notes"][:1]
    edge_hooks.apply(section, hooks, MS, [1, 8])
    assert section.notes[0].startswith("C++ libtorch row: not available")
    assert section.ratios["lora_step_torchscript_time_vs_pt2_b8"] == pytest.approx(1.2)
    assert section.ratios["cpp_libtorch_vs_ort_fp32_b8"] is None
    assert {r["runtime"] for r in section.rows} == {"lora_step_pt2", "lora_step_torchscript"}
    goal = next(g for g in section.goals if g.name.startswith("LoRA step through TorchScript"))
    assert goal.met is True
