"""The benchmark suite's plumbing: ratios and goals from rows, the report files, the CLI's contract.

Timings are never asserted (benchmarks/ measures them); these tests check that what a section
measured reaches results.json, the markdown and the plots, and that bad usage exits 2."""

from __future__ import annotations

import importlib.util
import json

import pytest
from click.testing import CliRunner

from benchmarks import edge, report, suite
from benchmarks.common import Goal, Options, Section


def _rows() -> list[dict]:
    ms = {("torch_plain", 1): 300.0, ("torch_prompted", 1): 360.0, ("ort_plain_fp32", 1): 200.0,
          ("ort_fp32", 1): 240.0, ("ort_int8", 1): 150.0, ("ort_int8_dynamic_all", 1): 120.0,
          ("torch_plain", 8): 250.0, ("torch_prompted", 8): 300.0, ("ort_plain_fp32", 8): 180.0,
          ("ort_fp32", 8): 220.0, ("ort_int8", 8): 110.0, ("ort_int8_dynamic_all", 8): 100.0}
    return [{"runtime": k, "batch": b, "ms_per_image": v, "peak_rss_mb": 100.0 + v,
             **({"agreement": 0.99} if k.startswith("ort_int8") else {})} for (k, b), v in ms.items()]


@pytest.mark.parametrize("key, expected", [
    ("ort_fp32_vs_torch_b1", 360 / 240),
    ("ort_fp32_vs_torch_b8", 300 / 220),
    ("ort_int8_vs_ort_fp32_b1", 240 / 150),
    ("ort_int8_vs_ort_fp32_b8", 2.0),
    ("ort_int8_dynamic_all_vs_ort_fp32_b8", 2.2),
    ("ort_fp32_gemm_peak_fraction_b8", 39.5 / 0.220 / 200),
    ("prompts_vs_floor_b8", (220 / 180) / (39.5 / 35.1)),
    ("torch_prompts_vs_floor_b1", (360 / 300) / (41.0 / 35.1)),
    ("ort_int8_static_all_vs_ort_fp32_b8", None),  # not measured: no row
])
def test_edge_ratios_come_from_the_rows(key, expected):
    ratios = edge.ratios(_rows(), {"plain": 35.1, "prompted": 41.0, "edge": 39.5}, 200.0, [1, 8])
    assert (ratios[key] is None) if expected is None else ratios[key] == pytest.approx(expected, rel=1e-3)


def test_goals_are_reported_met_not_met_or_unmeasured():
    goals = {g.name: g for g in edge.goals(edge.ratios(_rows(), {"plain": 35.1, "prompted": 41.0, "edge": 39.5}, 200.0, [1, 8]),
                                           [1, 8], 0.25)}
    assert goals["int8 (bundle, guarded) vs ORT fp32, b8"].met is True  # 2.0 >= 1.8
    assert goals["int8 (bundle, guarded) vs ORT fp32, b1"].met is True  # 1.6 >= 1.6
    assert goals["ORT fp32 vs PyTorch eager, b1"].met is True  # 1.5 >= 1.4
    assert goals["prompts' cost over their FLOP floor (ORT), b8"].met is False  # 1.086 > 1.05
    assert goals["int8 model file / fp32 model file (bundle, guarded)"].met is True
    assert Goal.at_most("x", None, 1.0).met is None


def test_report_writes_json_markdown_and_plots(tmp_path):
    section = Section("edge", config={"model": "fedmvp-tiny", "batches": [1, 8]}, rows=_rows(),
                      ratios={"ort_int8_vs_ort_fp32_b8": 2.0}, goals=[Goal.at_least("int8 b8", 2.0, 1.8),
                                                                      Goal.at_least("fp32 peak", 0.7, 0.85, "")],
                      notes=["a note"], seconds=3.0)
    train = Section("train", rows=[{"mode": "lora", "batch": 8, "checkpointing": True, "peak_rss_mb": 50.0}])
    from benchmarks.machine import describe

    results = {"command": "python -m benchmarks --quick", "machine": describe(2), "options": {},
               "sections": [section.to_json(), train.to_json()], "failed": []}
    files = report.write(results, tmp_path)
    assert {f.name for f in files} == {"results.json", "results.md", "latency.png", "memory.png",
                                       "agreement_speed.png"}
    assert all(f.stat().st_size > 0 for f in files)
    assert json.loads((tmp_path / "results.json").read_text())["sections"][0]["ratios"]["ort_int8_vs_ort_fp32_b8"] == 2.0
    text = (tmp_path / "results.md").read_text()
    assert "int8 b8: 2 (goal >= 1.8x): **met**" in text
    assert "fp32 peak: 0.7 (goal >= 0.85): **NOT met**" in text
    assert "| ort_int8 | 8 |" in text and "python -m benchmarks --quick" in text


@pytest.mark.parametrize("args, message", [
    (["--only", "edge,gpu"], "unknown section(s) gpu"),
    (["--only", "comm", "--run", "no-such-run"], "'no-such-run' does not exist"),
    (["--only", "comm", "--threads", "0"], "--threads"),
])
def test_bad_usage_is_one_line_and_exit_2(tmp_path, args, message):
    result = CliRunner().invoke(suite.cli, [*args, "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output
    assert not any(tmp_path.iterdir())


def test_a_failing_section_is_recorded_and_the_others_still_run(monkeypatch, tmp_path):
    import types

    def ok(options: Options) -> Section:
        return Section("ok", config={"quick": options.quick, "model": options.model}, rows=[{"x": 1}])

    def broken(options: Options) -> Section:
        raise RuntimeError("no such provider")

    monkeypatch.setitem(suite.SECTIONS, "ok", "fake_ok")
    monkeypatch.setitem(suite.SECTIONS, "broken", "fake_broken")
    monkeypatch.setitem(__import__("sys").modules, "fake_ok", types.SimpleNamespace(run=ok))
    monkeypatch.setitem(__import__("sys").modules, "fake_broken", types.SimpleNamespace(run=broken))
    result = CliRunner().invoke(suite.cli, ["--quick", "--only", "broken,ok", "--model", "fedmvp-tiny",
                                            "--out", str(tmp_path), "--json"])
    assert result.exit_code == 1
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["failed"] == ["broken: RuntimeError: no such provider"]
    assert data["sections"][1]["config"] == {"quick": True, "model": "fedmvp-tiny"}  # flags reach the sections
    assert data["options"]["only"] == ["broken", "ok"]


@pytest.mark.processes
def test_edge_and_prompts_quick_sections_measure_every_runtime():
    """The edge table end to end on the tiny model: every runtime timed at the asked batches, its
    ONNX file and memory measured, the issue's ratios present (values are the benchmark's business)."""
    from benchmarks import prompts

    section = edge.run(Options(quick=True, repeats=1, threads=1))
    runtimes = {"torch_plain", "torch_prompted", "ort_plain_fp32", "ort_fp32", "ort_int8", "ort_int8_dynamic_all",
                "ort_int8_static_all", "ort_int8_blockwise_all"}
    hooked = {"cpp_libtorch", "lora_step_pt2", "lora_step_torchscript"}  # benchmarks/edge_hooks.py's rows
    timed = [r for r in section.rows if r["runtime"] not in hooked]
    measured = {(r["runtime"], r["batch"]) for r in timed}
    kinds = {k for k, _ in measured}
    assert measured == {(k, b) for k in kinds for b in (1, 2)} and runtimes <= kinds
    openvino = {"openvino_fp32", "openvino_bf16", "openvino_int8"}  # where installed (bf16: where the CPU has it)
    assert kinds - runtimes <= openvino | {"auto", "torchscript"}  # torchscript: the bundle's model.torchscript.pt
    assert "torchscript" in kinds and section.ratios["torchscript_vs_ort_fp32_b2"] > 0
    assert section.ratios["torchscript_check_top1_agreement"] == 1.0
    if importlib.util.find_spec("openvino") is not None:
        assert {"openvino_fp32", "openvino_int8", "auto"} <= kinds
    assert all(r["ms_per_image"] > 0 for r in timed)
    steps = {r["runtime"]: r["ms_per_step"] for r in section.rows if r["runtime"].startswith("lora_step_")}
    assert set(steps) == {"lora_step_pt2", "lora_step_torchscript"} and all(v > 0 for v in steps.values())
    assert section.ratios["lora_step_torchscript_time_vs_pt2_b2"] > 0
    assert section.config["build_seconds"]["export_training"] > 0  # the steps ran on the table's own bundle
    if any(r["runtime"] == "cpp_libtorch" for r in section.rows):  # where a compiler and libjpeg/libpng exist
        assert section.ratios["cpp_libtorch_check_top1_agreement"] == 1.0
        assert section.ratios["cpp_libtorch_vs_ort_fp32_b2"] > 0
    else:
        assert any(n.startswith("C++ libtorch row:") for n in section.notes)
    assert all(r["peak_rss_mb"] for r in section.rows if r["runtime"] in runtimes)  # measured in a fresh process
    assert section.config["threads"] == 1 and section.config["model"] == "fedmvp-tiny"
    assert section.config["int8_plan"]["sensitivity"] == "first-order"
    for key in ("ort_fp32_vs_torch_b1", "ort_int8_vs_ort_fp32_b2", "ort_fp32_gemm_peak_fraction_b2",
                "prompts_vs_floor_b2"):
        assert section.ratios[key] > 0
    fp32 = next(r for r in section.rows if r["runtime"] == "ort_fp32")
    assert fp32["agreement"] == 1.0 and fp32["max_abs_logit_diff"] == 0.0
    text = prompts.run(Options(quick=True, repeats=1))
    assert {r["runtime"] for r in text.rows} >= {"torch_prompted", "torch_prompted_edge", "torch_prompted_reencode"}
    assert text.ratios["cached_vs_reencode_b1"] > 0
