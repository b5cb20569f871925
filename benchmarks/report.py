"""What the suite writes: results.json, results.md (tables, ratios, goals met / not met) and PNG plots."""

from __future__ import annotations

from pathlib import Path

from benchmarks.common import Goal, Section

MARK = {True: "met", False: "NOT met", None: "not measured"}


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)\n"
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def goal_line(goal: Goal | dict) -> str:
    g = goal if isinstance(goal, dict) else goal.__dict__
    value = "-" if g["value"] is None else f"{g['value']:.3g}"
    return f"- {g['name']}: {value} (goal {g['target']}): **{MARK[g['met']]}**"


def section_markdown(section: Section | dict) -> str:
    s = section if isinstance(section, dict) else section.to_json()
    parts = [f"### {s['name']}  ({s['seconds']:.0f} s)\n"]
    config = {k: v for k, v in s["config"].items() if not isinstance(v, (dict, list)) or k == "batches"}
    if config:
        parts.append(", ".join(f"{k}={_cell(v)}" for k, v in config.items()) + "\n")
    parts.append(table(s["rows"]))
    ratios = {k: v for k, v in s["ratios"].items() if v is not None}
    if ratios:
        parts.append("ratios: " + ", ".join(f"`{k}` {v:.3g}" for k, v in ratios.items()) + "\n")
    if s["goals"]:
        parts.append("\n".join(goal_line(g) for g in s["goals"]) + "\n")
    parts += [f"- note: {n}" for n in s["notes"]]
    return "\n".join(parts)


def suite_markdown(results: dict) -> str:
    from benchmarks.machine import line

    head = [f"## fedmvp benchmarks ({results['machine']['when']})\n", f"`{results['command']}`\n",
            f"Machine: {line(results['machine'])}\n"]
    return "\n".join(head + [section_markdown(s) for s in results["sections"]])


def write(results: dict, out: Path) -> list[Path]:
    """results.json, results.md and the plots into ``out``; returns the files written."""
    from fedmvp.atomic import write_json, write_text

    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", results)
    write_text(out / "results.md", suite_markdown(results))
    return [out / "results.json", out / "results.md", *plots(results, out)]


def plots(results: dict, out: Path) -> list[Path]:
    """latency.png, memory.png, agreement_speed.png from whichever sections have the columns; fleet.png
    (benchmarks.fleet_model) where the fleet section ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    rows = [dict(r, section=s["name"]) for s in results["sections"] for r in s["rows"]]
    latency = [r for r in rows if r.get("ms_per_image") is not None and "runtime" in r and "batch" in r]
    if latency:
        runtimes = list(dict.fromkeys(r["runtime"] for r in latency))
        batches = sorted({r["batch"] for r in latency})
        fig, ax = plt.subplots(figsize=(9, 4.5))
        width = 0.8 / len(batches)
        for i, batch in enumerate(batches):
            values = [next((r["ms_per_image"] for r in latency if r["runtime"] == k and r["batch"] == batch), 0)
                      for k in runtimes]
            ax.bar([x + i * width for x in range(len(runtimes))], values, width, label=f"batch {batch}")
        ax.set_xticks([x + width * (len(batches) - 1) / 2 for x in range(len(runtimes))], runtimes, rotation=25,
                      ha="right")
        ax.set_ylabel("ms per image")
        ax.set_title("latency per runtime and batch")
        ax.legend()
        written.append(_save(fig, out / "latency.png"))
    memory = [r for r in rows if r.get("peak_rss_mb") is not None or r.get("peak_gpu_mb") is not None]
    if memory:
        labels = [_label(r) for r in memory]
        values = [r.get("peak_gpu_mb") if r.get("peak_gpu_mb") is not None else r["peak_rss_mb"] for r in memory]
        fig, ax = plt.subplots(figsize=(9, max(3, 0.3 * len(labels))))
        ax.barh(range(len(labels)), values)
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        ax.set_xlabel("peak memory (MB; GPU where measured, else resident)")
        ax.set_title("memory")
        written.append(_save(fig, out / "memory.png"))
    agree = [r for r in latency if r.get("agreement") is not None]
    if agree:
        fp32 = {r["batch"]: r["ms_per_image"] for r in agree if r["runtime"] == "ort_fp32"}
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for r in agree:
            if r["batch"] in fp32:
                speed = fp32[r["batch"]] / r["ms_per_image"]
                ax.scatter(speed, 100 * r["agreement"])
                ax.annotate(f"{r['runtime']} b{r['batch']}", (speed, 100 * r["agreement"]), fontsize=7)
        ax.set_xlabel("speed-up over ORT fp32")
        ax.set_ylabel("top-1 agreement with fp32 (%)")
        ax.set_title("agreement vs speed")
        written.append(_save(fig, out / "agreement_speed.png"))
    fleet = next((s for s in results["sections"] if s["name"] == "fleet"), None)
    if fleet is not None:
        from benchmarks.fleet_model import plot as fleet_plot

        written += [p for p in [fleet_plot(fleet, out / "fleet.png")] if p is not None]
    return written


def _label(row: dict) -> str:
    parts = [row.get("section", ""), str(row.get("runtime") or row.get("mode") or "")]
    if "batch" in row:
        parts.append(f"b{row['batch']}")
    if "checkpointing" in row:
        parts.append("ckpt" if row["checkpointing"] else "no ckpt")
    return " ".join(p for p in parts if p)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path
