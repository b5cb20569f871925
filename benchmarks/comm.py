"""Bytes per client per round: the full message (PromptFormer + LoRA) against the LoRA-only one.

Before the LoRA switch a client uploads every PromptFormer tensor (``promptformer.*``) and the
LoRA (``lora.*``); after it, the LoRA alone (docs/method.md §3-4). Sizes come from the real
model's state (default FedMVPConfig, random-init backbone: sizes do not depend on the weights),
in fp32 (what travels today, fedmvp.federated.wire) and fp16 (what halving would save). Next to
the raw tensor bytes, the bytes of the Flower records as actually serialised (protobuf): the packed
ArrayRecord and its layout ConfigRecord (fedmvp_formats.packed), which add names, shapes and dtypes. The paper's figure, 267.08x, is PromptFormer / LoRA
parameters (docs/method.md §3); the full message / LoRA-only ratio adds the LoRA to the numerator.

    python -m benchmarks.comm            # table
    python -m benchmarks.comm --json     # the Section record
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks.common import Goal, Options, Section, ratio  # noqa: E402
from benchmarks.edge_refresh import MODELS, message_bytes  # noqa: E402
from benchmarks.sections_cli import section_main, show_ratios  # noqa: E402

PAPER_RATIO = 267.08  # PromptFormer / LoRA parameters on ViT-B/16 (docs/method.md §3, docs/benchmarks.md)
DTYPES = {"fp32": np.float32, "fp16": np.float16}


def model_tensors(name: str) -> dict[str, dict[str, np.ndarray]]:
    """The PromptFormer and LoRA tensors (fp32 numpy) of the default FedMVP on backbone ``name``."""
    import torch

    from fedmvp.clip import load_clip
    from fedmvp.model import FedMVP

    torch.manual_seed(0)
    model = FedMVP(load_clip(name, None))
    return {kind: {k: v.numpy() for k, v in model.state(kind).items()} for kind in ("promptformer", "lora")}


def flower_bytes(tensors: dict[str, np.ndarray]) -> int:
    """Bytes of the record a round message carries its tensors in (the packed .npy bytes and their
    layout, folded into the message's one ConfigRecord), serialised as Flower sends them (protobuf)."""
    from flwr.app import ConfigRecord
    from flwr.common.serde import config_record_to_proto

    from fedmvp_formats.envelope import fold

    from fedmvp.federated.wire import state_records

    return config_record_to_proto(ConfigRecord(fold(state_records(tensors)))).ByteSize()


def message_rows(name: str, parts: dict[str, dict[str, np.ndarray]]) -> list[dict]:
    """One row per (message, dtype): tensors, parameters, raw bytes and serialised Flower bytes."""
    messages = {"full": {**parts["promptformer"], **parts["lora"]}, "lora_only": parts["lora"]}
    rows = []
    for message, tensors in messages.items():
        for dtype, np_dtype in DTYPES.items():
            cast = {k: v.astype(np_dtype) for k, v in tensors.items()}
            rows.append({"model": name, "message": message, "dtype": dtype, "tensors": len(cast),
                         "parameters": int(sum(v.size for v in cast.values())),
                         "bytes": int(sum(v.nbytes for v in cast.values())), "flower_bytes": flower_bytes(cast)})
    return rows


def _row(rows: list[dict], model: str, message: str, dtype: str) -> dict:
    return next(r for r in rows if (r["model"], r["message"], r["dtype"]) == (model, message, dtype))


def run(options: Options) -> Section:
    """Message sizes for fedmvp-tiny and ViT-B-16 (both even with --quick: seconds either way; --quick
    skips the cross-check against benchmarks/edge_refresh.py, which builds each model again)."""
    began = time.perf_counter()
    section = Section(name="comm", config={"models": list(MODELS), "dtypes": list(DTYPES),
                                           "method": "default FedMVPConfig, random-init backbone"})
    for name in MODELS:
        parts = model_tensors(name)
        section.rows += message_rows(name, parts)
        if not options.quick:  # benchmarks/edge_refresh.py's fp32 figures (a second model build): the same
            check = message_bytes(name)
            if check["refresh_message_bytes"] != _row(section.rows, name, "full", "fp32")["bytes"]:
                section.notes.append(f"{name}: edge_refresh.message_bytes disagrees with this section's fp32 bytes")
        for dtype in DTYPES:
            full, lora = _row(section.rows, name, "full", dtype), _row(section.rows, name, "lora_only", dtype)
            section.ratios[f"{name} full/lora {dtype}"] = ratio(full["bytes"], lora["bytes"])
            section.ratios[f"{name} full/lora {dtype} flower"] = ratio(full["flower_bytes"], lora["flower_bytes"])
        pf = sum(v.size for v in parts["promptformer"].values())
        section.ratios[f"{name} promptformer/lora params"] = ratio(pf, _row(section.rows, name, "lora_only",
                                                                            "fp32")["parameters"])
    paper = section.ratios["ViT-B-16 promptformer/lora params"]
    section.goals.append(Goal.at_least("ViT-B-16 PromptFormer/LoRA parameters (paper 267.08x)", paper,
                                       PAPER_RATIO - 0.01))
    section.notes.append("full = promptformer.* + lora.* (before the LoRA switch); lora_only = lora.* (after). "
                         "flower_bytes: flwr ArrayRecord + layout ConfigRecord protobuf ByteSize, names and shapes included.")
    section.seconds = time.perf_counter() - began
    return section


def show(section: Section) -> None:
    """A readable table of the rows and ratios."""
    print(f"{'model':<12} {'message':<10} {'dtype':<5} {'params':>11} {'bytes':>13} {'flower bytes':>13}")
    for r in section.rows:
        print(f"{r['model']:<12} {r['message']:<10} {r['dtype']:<5} {r['parameters']:>11,} {r['bytes']:>13,} "
              f"{r['flower_bytes']:>13,}")
    show_ratios(section)


def main(argv: list[str] | None = None) -> int:
    return section_main(run, show, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
