"""A run's metrics writer: metrics.jsonl / metrics.csv (one row per round) and accuracy.png.

Kept apart from ``fedmvp.runs`` (layout and checkpoints): a round's checkpoint is the record, the
rows are a view of it; every row is also in its round's state.json ``metrics``, so a row lost to a
cut-short line comes back from there (``truncate_metrics_after``). All writes atomic.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from fedmvp_formats import strict_json

from fedmvp import atomic
from fedmvp.federated.metrics import SITE_COUNT_KEYS
from fedmvp.runs import RunDir, warn

METRICS = RunDir.METRICS
METRIC_COLUMNS = ["round", "train_loss", "train_ce", "train_consistency", "lora_clients", "clients",
                  "local", "base", "new", "hm", "domain", "edges", "edge_acc", "source", "updates", "examples",
                  "epsilon", *SITE_COUNT_KEYS]  # how many sites each metric is a mean over (docs/method.md §7)


def metrics_path(run: RunDir) -> Path:
    return run.path / run.METRICS


def read_metrics(run: RunDir) -> list[dict[str, Any]]:
    """Rows of metrics.jsonl; a line that is no JSON object (e.g. cut short by a full disk) is dropped
    with a warning: the rounds' own state.json records hold the same rows (``truncate_metrics_after``)."""
    path = metrics_path(run)
    if not path.is_file():
        return []
    rows = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict):
            warn(f"{path}: line {number} is not a JSON object (cut short?); dropped")
            continue
        rows.append(row)
    return rows


def append_metrics(run: RunDir, row: dict[str, Any]) -> None:
    """Rewrite metrics.jsonl/csv atomically with ``row`` (replacing an older row of the same round)."""
    rows = [r for r in read_metrics(run) if r.get("round") != row.get("round")] + [row]
    rows.sort(key=lambda r: r.get("round", 0))
    atomic.write_text(metrics_path(run), "".join(strict_json.dumps(r) + "\n" for r in rows))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=METRIC_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(strict_json.finite_or_null(rows))  # an empty cell, never "nan" or "inf"
    atomic.write_text(run.path / run.METRICS_CSV, buffer.getvalue())


def truncate_metrics_after(run: RunDir, round_number: int) -> None:
    """On resume, forget metrics of rounds that never completed; rows missing from metrics.jsonl (a
    line cut short) come back from their round's state.json (``RunDir.round_state``: one refused is named)."""
    kept = {r.get("round"): r for r in read_metrics(run) if r.get("round", 0) <= round_number}
    for number in run.rounds():
        if number <= round_number and number not in kept:
            row = run.round_state(number).get("metrics")
            if isinstance(row, dict):
                kept[number] = row
    rows = [kept[k] for k in sorted(kept, key=lambda k: k or 0)]
    atomic.write_text(metrics_path(run), "".join(strict_json.dumps(r) + "\n" for r in rows))


def plot(run: RunDir) -> Path | None:
    """accuracy.png: Local/Base/New/HM per evaluated round, zero-shot as dashed lines."""
    rows = [r for r in read_metrics(run) if r.get("hm") is not None]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    zero_shot = run.read_zero_shot() or {}
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for key, colour in (("local", "C0"), ("base", "C1"), ("new", "C2"), ("hm", "C3"), ("domain", "C4")):
        points = [(r["round"], 100 * r[key]) for r in rows if r.get(key) is not None]
        if not points:  # e.g. no new classes (domain protocols), no held-out domain
            continue
        ax.plot(*zip(*points), marker="o", color=colour, label=key.capitalize() if key != "hm" else "HM")
        if zero_shot.get(key) is not None:
            ax.axhline(100 * zero_shot[key], color=colour, linestyle="--", linewidth=0.8)
    ax.set_xlabel("round")
    ax.set_ylabel("top-1 accuracy (%)")
    ax.set_title(f"{run.path.name} (dashed: zero-shot)")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    target = run.path / run.PLOT
    with atomic.atomic_path(target) as tmp:
        fig.savefig(tmp, format="png", bbox_inches="tight")
    plt.close(fig)
    return target
