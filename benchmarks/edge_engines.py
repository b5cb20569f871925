"""The edge table's engine rows: every runtime of edge-client's registry beyond ONNX Runtime and OpenVINO.

Why: `fedmvp-export --format torchscript` ships ``model.torchscript.pt`` and `edge-client --runtime
torchscript` runs it (``edge_client/torchscript_runtime.py``); more engines register the same way
(``edge_client/engines.py``). Each one the bundle offers becomes a row named after it (``torchscript``,
``executorch``), opened by ``open_engine`` as a device opens it and timed interleaved with the others
(``benchmarks/edge.py``). A runtime expected here but not registered, not installed or not offered by
the bundle is a note, never a failure, so rows appear as soon as the engine and its artifact exist.

Ratios per engine row and batch: ``<row>_vs_ort_fp32_bN`` (ONNX Runtime fp32 ms / the row's ms: above
1 is faster, as the ``auto`` ratios) and ``<row>_time_vs_torch_prompted_bN`` (the row's ms / PyTorch
eager's: at most 1.2 is the TorchScript goal); ``<row>_check_top1_agreement`` and
``<row>_check_max_abs_logit_diff``: against ONNX Runtime fp32 on the bundle's own check images (what
`--runtime auto` verifies on), where the goal is 1.0, image for image.

    python -m benchmarks.edge_engines --model ViT-B-16 --repeats 3   # these rows alone (no int8, no memory)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import Goal, Options, Section, ratio

EXPECTED = ("torchscript", "executorch")  # looked for even before they are registered (a note says why not)
COVERED = ("ort", "openvino")  # the ort_* / openvino_* / auto rows (benchmarks/edge.py, edge_runtimes.py)
LABELS = {"torchscript": "TorchScript", "executorch": "ExecuTorch"}
CHECK_BATCH = 8


def engine_names() -> list[str]:
    """The expected engines, then every other registered one the other rows do not cover."""
    from edge_client.engines import runtime_names

    return list(dict.fromkeys([*EXPECTED, *(n for n in runtime_names() if n not in COVERED)]))


def engine_runners(bundle_path: Path, threads: int) -> tuple[dict[str, Callable], list[str]]:
    """``{row: run(pixels)}`` (logits first) for every engine ``bundle_path`` offers here, and one note per
    engine left out and why. A row is the engine's name; a second precision it offers is ``<name>_<precision>``."""
    from benchmarks.edge_runtimes import _runner
    from edge_client.bundle import Bundle
    from edge_client.engines import Candidate, factory, offered, open_engine, runtime_names, unavailable

    bundle = Bundle.open(bundle_path)
    out: dict[str, Callable] = {}
    notes: list[str] = []
    registered = runtime_names()
    for name in engine_names():
        if name not in registered:
            notes.append(f"{name} rows: not registered in edge_client.engines in this checkout")
            continue
        why = unavailable(name)
        if why is not None:
            notes.append(f"{name} rows: {why}")
            continue
        precisions = offered(name, bundle)
        if not precisions:
            why_not = getattr(factory(name), "not_offered", None)
            notes.append(f"{name} rows: {(why_not(bundle) if why_not else None) or 'offers nothing for this bundle'}")
            continue
        for i, precision in enumerate(sorted(precisions, key=lambda p: p != "fp32")):  # fp32 first
            row = name if i == 0 else f"{name}_{precision}"
            try:
                out[row] = _runner(open_engine(bundle, Candidate(name, precision), "cpu", threads))
            except Exception as err:  # noqa: BLE001 - an engine that cannot open is a note, not a crash
                notes.append(f"{row}: {' '.join(str(err).split())[:200]}")
    return out, notes


def engine_rows(runs: dict[str, Any]) -> list[str]:
    """The rows of ``runs`` that are engine rows (``engine_runners``' keys)."""
    names = engine_names()
    return [key for key in runs if key in names or any(key.startswith(f"{n}_") for n in names)]


def _logits(run: Callable, pixels: np.ndarray) -> np.ndarray:
    return np.concatenate([run(pixels[i:i + CHECK_BATCH])[0] for i in range(0, len(pixels), CHECK_BATCH)])


def check_agreement(runs: dict[str, Callable], bundle_path: Path, rows: list[str]) -> dict[str, dict]:
    """Top-1 agreement and max |logit diff| of each of ``rows`` with ONNX Runtime fp32 on the bundle's
    check images (``Bundle.check_images``); also ``reference_top1``, ORT's top-1 per image, for the
    figures measured elsewhere (the C++ binary's, ``benchmarks/edge_hooks.py``)."""
    from edge_client.bundle import Bundle

    if "ort_fp32" not in runs:
        return {}
    pixels = Bundle.open(bundle_path).check_images().pixels
    reference = _logits(runs["ort_fp32"], pixels)
    out: dict[str, Any] = {"reference_top1": reference.argmax(-1).tolist()}
    for row in rows:
        logits = _logits(runs[row], pixels)
        out[row] = {"check_images": len(pixels),
                    "check_top1_agreement": float(np.mean(logits.argmax(-1) == reference.argmax(-1))),
                    "check_max_abs_logit_diff": float(np.max(np.abs(logits - reference)))}
    return out


def engine_ratios(ms: dict[tuple[str, int], float], batches: list[int], rows: list[str],
                  checks: dict[str, dict]) -> dict[str, float | None]:
    """Each engine row against ONNX Runtime fp32 and PyTorch eager at every batch, and its check-image
    agreement; the TorchScript keys are always there (None: not measured)."""
    out: dict[str, float | None] = {}
    for row in dict.fromkeys(["torchscript", *rows]):
        for b in batches:
            out[f"{row}_vs_ort_fp32_b{b}"] = ratio(ms.get(("ort_fp32", b)), ms.get((row, b)))
            out[f"{row}_time_vs_torch_prompted_b{b}"] = ratio(ms.get((row, b)), ms.get(("torch_prompted", b)))
        check = checks.get(row, {})
        out[f"{row}_check_top1_agreement"] = check.get("check_top1_agreement")
        out[f"{row}_check_max_abs_logit_diff"] = check.get("check_max_abs_logit_diff")
    return {k: (float(f"{v:.4g}") if v is not None else None) for k, v in out.items()}  # a 1e-6 diff stays one


def engine_goals(r: dict[str, float | None], batches: list[int], model: str, rows: list[str]) -> list[Goal]:
    """TorchScript's speed goal against PyTorch eager at the largest batch; every engine's check-image goal."""
    big = batches[-1]
    goals = [Goal.at_most(f"TorchScript inference within 1.2x of PyTorch eager at batch {big} on {model} "
                          f"(time ratio)", r.get(f"torchscript_time_vs_torch_prompted_b{big}"), 1.2)]
    for row in dict.fromkeys(["torchscript", *rows]):
        label = LABELS.get(row, row)
        goals.append(Goal.at_least(f"{label} top-1 equals fp32 ONNX on the check images (agreement)",
                                   r.get(f"{row}_check_top1_agreement"), 1.0, ""))
    return goals


def run(options: Options) -> Section:
    """The engine rows alone beside PyTorch eager and ONNX Runtime fp32 (no int8, OpenVINO or memory probe):
    the quick way to the TorchScript figures on ViT-B-16."""
    import tempfile

    from benchmarks import edge, edge_hooks, edge_models
    from benchmarks.common import set_threads

    edge._quiet()
    start = time.perf_counter()
    threads = set_threads(options.threads)
    name = options.model or (edge.QUICK_MODEL if options.quick else edge.DEFAULT_MODEL)
    classes, attributes = (16, 3) if options.quick else (100, 10)
    batches = [1, 2] if options.quick else [1, 8]
    section = Section("edge_engines", config={"model": name, "classes": classes, "attributes_per_class": attributes,
                                              "batches": batches, "threads": threads, "repeats": options.reps()})
    with tempfile.TemporaryDirectory(prefix="fedmvp-bench-engines-") as tmp:
        models = edge_models.build(name, Path(tmp), classes=classes, attributes=attributes,
                                   pretrained="synthetic" if name == edge.QUICK_MODEL else None,
                                   int8=False, variants=False)
        runs, notes = edge.runners(models, threads, "cpu")
        runs = {k: v for k, v in runs.items() if k in ("torch_prompted", "ort_fp32")}
        more, skipped = engine_runners(models.bundle, threads)
        runs.update(more)
        section.notes += notes + skipped
        rows = engine_rows(runs)
        section.rows = edge.time_runtimes(runs, models.image_size, batches, options.reps())
        checks = check_agreement(runs, models.bundle, rows)
        del runs
        hooks = edge_hooks.measure(models.bundle, Path(tmp), name, classes, attributes, batches, options.reps(),
                                   checks.get("reference_top1"))
    for row in section.rows:
        row.update(checks.get(row["runtime"], {}))
    ms = {(r["runtime"], r["batch"]): r["ms_per_image"] for r in section.rows}
    section.ratios = engine_ratios(ms, batches, rows, checks)
    section.goals = engine_goals(section.ratios, batches, name, rows)
    edge_hooks.apply(section, hooks, ms, batches)
    section.config.update({"build_seconds": {k: round(v, 2) for k, v in models.build_seconds.items()},
                           "parity": models.parity, "torchscript_file_mb": round(
                               models.file_bytes.get("torchscript", 0) / 1e6, 2) or None})
    section.seconds = round(time.perf_counter() - start, 1)
    return section


def main(argv: list[str] | None = None) -> int:
    from benchmarks.sections_cli import section_main, show_table

    return section_main(run, show_table, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
