"""Two figures of the edge table measured by modules of their own, plugged in where they exist.

Hook points (each imported guarded: a checkout without the module gets a note "not available", and the
ratios and goals below stay in the table as not measured):

- ``benchmarks.edge_cpp.cpp_ms_per_image(bundle, batch_sizes, repeats) -> dict``: the C++ libtorch
  binary running the bundle's model.torchscript.pt (docs/howto/cpp-libtorch.md). Read from the dict:
  ``cpp`` ``{batch: median ms per image}`` and ``top1`` (the binary's top-1 class per check image, in the
  bundle's check-image order). Row ``cpp_libtorch``; ratios
  ``cpp_libtorch_vs_ort_fp32_bN`` (ORT ms / C++ ms), ``cpp_libtorch_check_top1_agreement``; goal
  "C++ agrees with ORT image for image". Timed in its own process, so not interleaved with the others.
- ``benchmarks.edge_train_formats.train_step_rows(bundle, batch, repeats) -> dict``: one LoRA step through
  train.pt2 and through train.torchscript.pt on the table's bundle (edge_models.build exports it trainable
  with TorchScript), else on one exported for it. Read from the dict: ``pt2_ms`` and ``torchscript_ms``
  (median ms per step). Rows ``lora_step_pt2`` / ``lora_step_torchscript``; ratio
  ``lora_step_torchscript_time_vs_pt2_bN`` (TorchScript ms / pt2 ms); goal "LoRA step through
  TorchScript within 1.3x of train.pt2".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.common import Goal, Section, ratio

CPP_ROW = "cpp_libtorch"


def _short(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"


def measure(bundle: Path, work: Path, name: str, classes: int, attributes: int, batches: list[int], repeats: int,
            reference_top1: list[int] | None) -> dict[str, Any]:
    """Both hooks' figures where their modules exist: ``{"cpp", "train", "notes"}``."""
    out: dict[str, Any] = {"cpp": None, "train": None, "train_batch": batches[-1], "notes": [],
                           "reference_top1": reference_top1}
    try:
        from benchmarks.edge_cpp import cpp_ms_per_image
    except ImportError:
        out["notes"].append("C++ libtorch row: not available (benchmarks.edge_cpp is not in this checkout)")
    else:
        try:
            out["cpp"] = cpp_ms_per_image(bundle, list(batches), repeats)
        except Exception as err:  # noqa: BLE001 - e.g. the binary is not built here: a note, not a crash
            out["notes"].append(f"C++ libtorch row: {_short(err)}")
    try:
        from benchmarks.edge_train_formats import train_step_rows
    except ImportError:
        out["notes"].append("LoRA step rows (train.pt2 vs TorchScript): not available "
                            "(benchmarks.edge_train_formats is not in this checkout)")
    else:
        from benchmarks.edge_models import random_bundle

        try:  # the table's bundle where it carries both training files (edge_models.build), else one exported here
            manifest = json.loads((Path(bundle) / "manifest.json").read_text())
            roles = manifest.get("files_by_role", {})
            trainable = bundle if {"training", "torchscript_training"} <= set(roles) else \
                random_bundle(work / "train", name, classes, attributes, training=True, torchscript=True)
            out["train"] = train_step_rows(trainable, batches[-1], repeats)
        except Exception as err:  # noqa: BLE001
            out["notes"].append(f"LoRA step rows (train.pt2 vs TorchScript): {_short(err)}")
    return out


def cpp_figures(result: dict, reference_top1: list[int] | None) -> tuple[dict[int, float], float | None, int | None]:
    """``({batch: ms per image}, top-1 agreement with ORT fp32 on the check images, images compared)``."""
    ms = {int(k): float(v) for k, v in (result.get("cpp") or {}).items() if v is not None}
    top1, agreement, images = result.get("top1"), None, None
    if top1 is not None and reference_top1:
        images = len(reference_top1)
        same = sum(int(a) == int(b) for a, b in zip(top1, reference_top1))
        agreement = same / len(reference_top1)  # a missing image is a disagreement
    return ms, agreement, images


def train_figures(result: dict) -> dict[str, float]:
    """``{"pt2": ms per step, "torchscript": ms per step}`` from what ``train_step_rows`` returned."""
    return {kind: float(result[f"{kind}_ms"]) for kind in ("pt2", "torchscript") if result.get(f"{kind}_ms") is not None}


def apply(section: Section, hooks: dict[str, Any], ms: dict[tuple[str, int], float], batches: list[int]) -> None:
    """The hooks' rows, ratios (None where not measured) and goals into ``section``."""
    section.notes += hooks["notes"]
    ms_cpp, agreement, images = cpp_figures(hooks["cpp"], hooks["reference_top1"]) if hooks["cpp"] else ({}, None, None)
    if ms_cpp:
        section.notes.append(f"{CPP_ROW}: timed by benchmarks.edge_cpp after the interleaved rows, not among them")
    for b in batches:
        if b in ms_cpp:
            section.rows.append({"runtime": CPP_ROW, "batch": b, "ms_per_batch": round(ms_cpp[b] * b, 2),
                                 "ms_per_image": round(ms_cpp[b], 2), "check_images": images,
                                 "check_top1_agreement": agreement})
        section.ratios[f"{CPP_ROW}_vs_ort_fp32_b{b}"] = _round(ratio(ms.get(("ort_fp32", b)), ms_cpp.get(b)))
        section.ratios[f"{CPP_ROW}_time_vs_torchscript_b{b}"] = _round(ratio(ms_cpp.get(b), ms.get(("torchscript", b))))
    section.ratios[f"{CPP_ROW}_check_top1_agreement"] = agreement
    section.goals.append(Goal.at_least("C++ agrees with ORT image for image (top-1 agreement on the check images)",
                                       agreement, 1.0, ""))
    batch = hooks["train_batch"]
    steps = train_figures(hooks["train"]) if hooks["train"] else {}
    for kind, value in steps.items():
        section.rows.append({"runtime": f"lora_step_{kind}", "batch": batch, "ms_per_step": round(value, 2)})
    slower = _round(ratio(steps.get("torchscript"), steps.get("pt2")))
    section.ratios[f"lora_step_torchscript_time_vs_pt2_b{batch}"] = slower
    section.goals.append(Goal.at_most(f"LoRA step through TorchScript within 1.3x of train.pt2 (time ratio, batch "
                                      f"{batch})", slower, 1.3))


def _round(value: float | None) -> float | None:
    return round(value, 4) if value is not None else None
