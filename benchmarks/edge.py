"""Edge inference side by side: PyTorch eager vs ONNX Runtime fp32 vs int8, against the machine's limit.

Runtimes (``runtime`` column): ``torch_plain`` (open_clip's image encoder, no prompts),
``torch_prompted`` (the fedmvp model with cached attribute text features), ``ort_plain_fp32``
(the plain encoder as ONNX), ``ort_fp32`` (the bundle's model.onnx), ``ort_int8`` (the exporter's
int8, accuracy bound on, the scheme `--int8-scheme auto` picked: ``int8_bundle_scheme``; its ratios
``ort_int8_vs_ort_fp32_b1`` / ``_b8``), ``ort_int8_dynamic_all`` / ``ort_int8_static_all`` /
``ort_int8_blockwise_all`` (every weight MatMul quantised); ``openvino_fp32`` / ``openvino_bf16`` /
``openvino_int8`` and ``auto`` (what `edge-client --runtime auto` picks here: ``edge_runtimes.py``);
one row per further engine of edge-client's registry the bundle offers, named after it: ``torchscript``
(the bundle's model.torchscript.pt), ``executorch`` once registered (``edge_engines.py``: ratios
``<row>_vs_ort_fp32_bN``, ``<row>_time_vs_torch_prompted_bN``, agreement on the bundle's check images);
the C++ libtorch binary (``cpp_libtorch``) and the LoRA step through train.pt2 and TorchScript
(``lora_step_*``) where their modules exist (``edge_hooks.py``).
On a trained run (``--run``): int8's accuracy drop, and the accuracy of what ``auto`` picks and of
OpenVINO bf16 against fp32 on the run's labelled test images (``edge_accuracy.py``).
All runtimes are timed interleaved in one process (medians), at batch 1 and 8 by default. FLOPs
are counted on the PyTorch model (2 per multiply-add); the GEMM peak is the best fp32 MatMul of
torch and ONNX Runtime here. Peak memory per runtime: one fresh process each
(``benchmarks/memory_probe.py``). Agreement: top-1 agreement and max |logit diff| with the
bundle's fp32 model on the benchmark's images (random weights: near-tied logits, so the figure
that counts is the trained tiny model's, from ``--run``).

    python -m benchmarks edge --model ViT-B-16 --json
    python -m benchmarks edge --quick
"""

from __future__ import annotations

import logging
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from benchmarks.common import Goal, Options, Section, interleaved_medians, ratio, set_threads

DEFAULT_MODEL = "ViT-B-16"
QUICK_MODEL = "fedmvp-tiny"


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("onnxscript", "onnx_ir", "torch.onnx", "torch._export", "root", ""):
        logging.getLogger(name).setLevel(logging.ERROR)


def flops_per_image(models) -> dict[str, float]:
    """GFLOP per image (torch's FLOP counter, batch 1) of plain CLIP, the training core's prompted
    forward, and the exported form the ONNX model computes (attribute keys/values precomputed):
    the floor of the ONNX prompts is ``edge / plain``."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from export.edge_module import build_edge_classifier
    from export.onnx_export import no_mha_fastpath

    x = torch.zeros(1, 3, models.image_size, models.image_size)
    edge = build_edge_classifier(models.model, models.model.text_features)
    out = {}
    for key, fn in (("plain", models.clip.model.visual), ("prompted", models.model), ("edge", edge)):
        counter = FlopCounterMode(display=False)
        with no_mha_fastpath(), torch.no_grad(), counter:
            fn(x)
        out[key] = counter.get_total_flops() / 1e9
    return out


def runners(models, threads: int, device: str) -> tuple[dict[str, object], list[str]]:
    """``{runtime: run(pixels)}`` for every runtime the models hold, and notes on what could not run.

    On ``cuda``: PyTorch on the GPU in fp32 and under fp16 autocast, ONNX Runtime's CUDA provider
    for every ONNX model, and TensorRT (fp16 model) where the build has it."""
    import torch

    from edge_client.runtime import ProviderError, make_session

    dev = torch.device(device)

    def torch_run(module, autocast: bool = False):
        module = module.to(dev)

        def run(pixels: np.ndarray):
            with torch.inference_mode(), torch.autocast("cuda", torch.float16, enabled=autocast):
                out = module(torch.from_numpy(pixels).to(dev))
            if dev.type == "cuda":
                torch.cuda.synchronize()
            return out
        return run

    out = {"torch_plain": torch_run(models.clip.model.visual), "torch_prompted": torch_run(models.model)}
    if dev.type == "cuda":
        out["torch_prompted_autocast_fp16"] = torch_run(models.model, autocast=True)
    notes = []
    providers = {key: "cuda" if dev.type == "cuda" else "cpu" for key in models.onnx}
    if dev.type == "cuda" and "ort_fp16" in models.onnx:
        providers["ort_trt_fp16"] = "tensorrt"
    for key, provider in providers.items():
        path = models.onnx["ort_fp16" if key == "ort_trt_fp16" else key]
        try:
            session, _ = make_session(path, provider=provider, threads=threads)
        except ProviderError as err:
            notes.append(f"{key}: {err}")
            continue
        name = session.get_inputs()[0].name
        out[key] = (lambda s, n: (lambda pixels: s.run(None, {n: pixels})))(session, name)
    return out, notes


def agreement(runs: dict, pixels: np.ndarray, engines: tuple[str, ...] = ()) -> dict[str, dict]:
    """Top-1 agreement and max |logit diff| of every ONNX runtime, and of the ``engines`` rows, with the
    fp32 bundle model."""
    if "ort_fp32" not in runs:  # e.g. --device cuda where ONNX Runtime has no CUDA provider
        return {}
    reference = runs["ort_fp32"](pixels)[0]
    out = {}
    for key, run in runs.items():
        if not (key.startswith(("ort_", "openvino_", "auto")) or key in engines) or "plain" in key:
            continue
        logits = run(pixels)[0]
        out[key] = {"agreement": float(np.mean(logits.argmax(-1) == reference.argmax(-1))),
                    "max_abs_logit_diff": float(np.max(np.abs(logits - reference)))}
    return out


def time_runtimes(runs: dict, image_size: int, batches: list[int], repeats: int) -> list[dict]:
    from benchmarks.edge_models import random_pixels

    rows = []
    for batch in batches:
        pixels = random_pixels(batch, image_size)
        medians = interleaved_medians({k: (lambda r: lambda: r(pixels))(r) for k, r in runs.items()}, repeats)
        rows += [{"runtime": k, "batch": batch, "ms_per_batch": round(1000 * s, 2),
                  "ms_per_image": round(1000 * s / batch, 2)} for k, s in medians.items()]
    return rows


def ratios(rows: list[dict], flops: dict, peak_gflops: float, batches: list[int]) -> dict[str, float | None]:
    ms = {(r["runtime"], r["batch"]): r["ms_per_image"] for r in rows}
    small, big = batches[0], batches[-1]
    out: dict[str, float | None] = {}
    for b, tag in ((small, "b1" if small == 1 else f"b{small}"), (big, f"b{big}")):
        out[f"ort_fp32_vs_torch_{tag}"] = ratio(ms.get(("torch_prompted", b)), ms.get(("ort_fp32", b)))
        out[f"ort_int8_vs_ort_fp32_{tag}"] = ratio(ms.get(("ort_fp32", b)), ms.get(("ort_int8", b)))
        for variant in ("dynamic_all", "static_all", "blockwise_all"):
            out[f"ort_int8_{variant}_vs_ort_fp32_{tag}"] = ratio(ms.get(("ort_fp32", b)),
                                                                 ms.get((f"ort_int8_{variant}", b)))
        fp32 = ms.get(("ort_fp32", b))
        out[f"ort_fp32_gemm_peak_fraction_{tag}"] = (flops["edge"] / (fp32 / 1000) / peak_gflops
                                                     if fp32 else None)
        for side, flop in (("torch", "prompted"), ("ort", "edge")):  # each against the FLOPs it computes
            plain = ms.get(("torch_plain" if side == "torch" else "ort_plain_fp32", b))
            prompted = ms.get(("torch_prompted" if side == "torch" else "ort_fp32", b))
            key = f"prompts_vs_floor_{tag}" if side == "ort" else f"torch_prompts_vs_floor_{tag}"
            out[key] = ratio(ratio(prompted, plain), flops[flop] / flops["plain"])
    from benchmarks.edge_runtimes import runtime_ratios

    out.update(runtime_ratios(ms, batches))
    return {k: (round(v, 4) if v is not None else None) for k, v in out.items()}


def goals(r: dict, batches: list[int], int8_bytes_fraction: float | None) -> list[Goal]:
    small = "b1" if batches[0] == 1 else f"b{batches[0]}"
    big = f"b{batches[-1]}"
    return [
        Goal.at_least(f"ORT fp32 share of the fp32 GEMM peak, {big}", r.get(f"ort_fp32_gemm_peak_fraction_{big}"),
                      0.85, ""),
        Goal.at_least(f"ORT fp32 vs PyTorch eager, {small}", r.get(f"ort_fp32_vs_torch_{small}"), 1.4),
        Goal.at_least(f"int8 (bundle, guarded) vs ORT fp32, {big}", r.get(f"ort_int8_vs_ort_fp32_{big}"), 1.8),
        Goal.at_least(f"int8 (bundle, guarded) vs ORT fp32, {small}", r.get(f"ort_int8_vs_ort_fp32_{small}"), 1.6),
        Goal.at_least(f"int8 (every MatMul, dynamic) vs ORT fp32, {big}",
                      r.get(f"ort_int8_dynamic_all_vs_ort_fp32_{big}"), 1.8),
        Goal.at_least(f"int8 (every MatMul, dynamic) vs ORT fp32, {small}",
                      r.get(f"ort_int8_dynamic_all_vs_ort_fp32_{small}"), 1.6),
        Goal.at_most(f"prompts' cost over their FLOP floor (ORT), {big}", r.get(f"prompts_vs_floor_{big}"), 1.05),
        Goal.at_least(f"auto (edge-client --runtime auto) vs ORT fp32, {big}", r.get(f"auto_vs_ort_fp32_{big}"), 2.0),
        Goal.at_least(f"auto (edge-client --runtime auto) vs ORT fp32, {small}", r.get(f"auto_vs_ort_fp32_{small}"),
                      1.6),
        Goal.at_most("int8 model file / fp32 model file (bundle, guarded)", int8_bytes_fraction, 0.30, ""),
        Goal.at_most("int8 model file / fp32 model file (every MatMul)", r.get("int8_all_file_fraction"), 0.30, ""),
    ]


def newest_demo_run(root: Path) -> Path | None:
    from fedmvp.runs import RunDir

    runs = sorted((p for p in (root / "runs").glob("demo-*") if RunDir(p).exists()),
                  key=lambda p: p.stat().st_mtime)
    return runs[-1] if runs else None


def trained_int8(run_path: Path, work: Path) -> dict:
    """The exporter's int8 on a trained run (e.g. `fedmvp demo`'s): what its accuracy bound measured on the
    run's labelled test images (fp32 and int8 accuracy, the drop in points), top-1 agreement with fp32
    there (the bundle's own parity check), the layers kept fp32 and the scheme `--int8-scheme auto` shipped
    (with what each candidate measured)."""
    from export.bundle_writer import BundleOptions, ExportOptions, export_bundle

    start = time.perf_counter()
    result = export_bundle(run_path, out=work / "trained-int8",
                           options=ExportOptions(BundleOptions(precision="int8", training=False)))
    plan = result.int8
    check = result.parity["int8"]
    return {"run": str(run_path), "test_images": check.images, "top1_agreement": check.top1_agreement,
            "max_abs_logit_diff": check.max_abs_logit_diff, "parity_passed": check.passed,
            "layers_quantised": len(plan.quantized), "layers_kept_fp32": len(plan.kept_fp32),
            "criterion": plan.criterion, "accuracy": plan.accuracy, "scheme": plan.scheme,
            "scheme_choice": plan.scheme_choice,
            "export_seconds": round(time.perf_counter() - start, 1)}


def run(options: Options) -> Section:
    """The edge table (see the module docstring)."""
    from benchmarks import edge_engines, edge_hooks, edge_models, machine, memory_probe

    _quiet()
    start = time.perf_counter()
    threads = set_threads(options.threads)
    name = options.model or (QUICK_MODEL if options.quick else DEFAULT_MODEL)
    classes, attributes = (16, 3) if options.quick else (100, 10)
    batches = [1, 2] if options.quick else [1, 8]
    provider = options.device
    section = Section("edge", config={"model": name, "pretrained": None if name != QUICK_MODEL else "synthetic",
                                      "classes": classes, "attributes_per_class": attributes, "batches": batches,
                                      "threads": threads, "provider": provider, "repeats": options.reps()})
    with tempfile.TemporaryDirectory(prefix="fedmvp-bench-edge-") as tmp:
        work = Path(tmp)
        models = edge_models.build(name, work, classes=classes, attributes=attributes,
                                   pretrained="synthetic" if name == QUICK_MODEL else None,
                                   calibration_images=16 if options.quick else 32,
                                   fp16=options.device == "cuda", int8=options.device == "cpu",
                                   variants=options.device == "cpu")
        flops = flops_per_image(models)
        peak = machine.gemm_peak(threads, quick=options.quick)
        runs, skipped = runners(models, threads, options.device)
        section.notes += skipped
        if options.device == "cpu":
            from benchmarks.edge_runtimes import runtime_runners

            more, skipped, picked = runtime_runners(models.onnx, threads)
            runs.update(more)
            section.notes += skipped
            section.config["auto"] = picked
            more, skipped = edge_engines.engine_runners(models.bundle, threads)
            runs.update(more)
            section.notes += skipped
        else:
            section.notes.append("engine rows (torchscript, executorch): CPU only, not run with --device cuda")
        engines = edge_engines.engine_rows(runs)
        section.rows = time_runtimes(runs, models.image_size, batches, options.reps())
        agree = agreement(runs, edge_models.random_pixels(16 if options.quick else 32, models.image_size, seed=3),
                          tuple(engines))
        checks = edge_engines.check_agreement(runs, models.bundle, engines)
        del runs
        hooks = edge_hooks.measure(models.bundle, work, name, classes, attributes, batches, options.reps(),
                                   checks.get("reference_top1"))
        memory = memory_probe.measure_all(models, work, threads, batches[-1], provider) if provider == "cpu" \
            else {}
        run_path = options.run or (None if options.quick else newest_demo_run(Path.cwd()))
        trained = trained_int8(run_path, work) if run_path else None
        runtimes = None
        if run_path and options.device == "cpu":
            from benchmarks.edge_accuracy import trained_runtimes
            from export.bundle_writer import DEFAULT_PARITY_IMAGES

            runtimes = trained_runtimes(run_path, work, threads, DEFAULT_PARITY_IMAGES)
    for row in section.rows:
        row.update(agree.get(row["runtime"], {}))
        row.update(checks.get(row["runtime"], {}))
        row["peak_rss_mb"] = memory.get(row["runtime"], {}).get("peak_rss_mb")
        row["model_mb"] = round(models.file_bytes[row["runtime"]] / 1e6, 2) if row["runtime"] in models.file_bytes \
            else None
    int8_fraction = ratio(models.file_bytes.get("ort_int8"), models.file_bytes.get("ort_fp32"))
    section.config.update({"gflop_per_image": {k: round(v, 3) for k, v in flops.items()},
                           "gemm_peak_gflops": peak["gflops"], "gemm": peak["shapes"],
                           "build_seconds": {k: round(v, 2) for k, v in models.build_seconds.items()},
                           "int8_plan": models.int8_plan, "memory": memory,
                           "int8_bundle_scheme": (models.int8_plan or {}).get("scheme")})
    section.ratios = ratios(section.rows, flops, peak["gflops"], batches)
    section.ratios["int8_file_fraction"] = round(int8_fraction, 4) if int8_fraction else None
    all_fraction = ratio(models.file_bytes.get("ort_int8_dynamic_all"), models.file_bytes.get("ort_fp32"))
    section.ratios["int8_all_file_fraction"] = round(all_fraction, 4) if all_fraction else None
    section.goals = goals(section.ratios, batches, int8_fraction)
    ms = {(r["runtime"], r["batch"]): r["ms_per_image"] for r in section.rows}
    section.ratios.update(edge_engines.engine_ratios(ms, batches, engines, checks))
    section.goals += edge_engines.engine_goals(section.ratios, batches, name, engines)
    edge_hooks.apply(section, hooks, ms, batches)
    section.config["parity"] = models.parity  # the fp32 bundle's: ONNX and TorchScript against PyTorch
    guard = ratio(models.build_seconds.get("export_int8_guard"), 1)
    guard = guard - models.build_seconds["export_fp32"] if guard is not None else None  # its fp32 part aside
    section.config["int8_guard_seconds"] = round(guard, 1) if guard is not None else None
    section.goals.append(Goal.at_most(f"int8 accuracy guard on {name}, seconds", guard, 180, " s"))
    section.config["trained_tiny_int8"] = trained
    held = (trained or {}).get("accuracy") or {}
    section.ratios["int8_accuracy_drop_points"] = held.get("drop_points")
    section.goals.append(Goal.at_most("int8 accuracy drop vs fp32 on the trained run's test images, points",
                                      held.get("drop_points"), 1.0, " points"))
    kept = trained and ratio(trained["layers_kept_fp32"], trained["layers_kept_fp32"] + trained["layers_quantised"])
    section.goals.append(Goal.at_most("int8 share of layers kept fp32 on the trained run (was 17 of 22 on the demo)",
                                      kept, 0.5, ""))
    from benchmarks.edge_accuracy import accuracy_ratios

    section.config["trained_runtimes"] = runtimes
    section.ratios.update(accuracy_ratios(runtimes))
    section.goals.append(Goal.at_most("auto accuracy drop vs fp32 on the trained run's test images, points (0 "
                                      "where it agrees 100%)", section.ratios["auto_accuracy_drop_points"],
                                      1.0, " points"))
    if trained is None:
        section.notes.append("no trained run (`--run`, or runs/demo-* here): int8 agreement on real weights "
                             "not measured; run `fedmvp demo` first")
    if name != QUICK_MODEL:
        section.notes.append("random-init weights: every image's logits are near-tied, so the accuracy guard "
                             "keeps most layers fp32 and agreement on them means little; the agreement goal is "
                             "measured on the trained run (`--run`), the int8 speed of the graph by the "
                             "every-MatMul rows")
    section.seconds = round(time.perf_counter() - start, 1)
    return section


def main(argv: list[str] | None = None) -> int:
    from benchmarks.sections_cli import section_main, show_table

    return section_main(run, show_table, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
