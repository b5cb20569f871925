"""What `edge-client infer` and `info` print for a person: the predictions table and the info lines.

Why apart: fedmvp_apps/edge_cli.py holds the commands and their options; how their results read is its
own concern (and keeps that module small). click and the standard library only.
"""

from __future__ import annotations

from typing import Any

import click


def print_table(predictions: list) -> None:
    if not predictions:
        return
    from edge_client.images import printable

    paths = [printable(str(p.path)) for p in predictions]
    width = min(max(len("PATH"), *(len(p) for p in paths)), 60)
    cwidth = max(len("CLASS"), *(len(c) for p in predictions for c, _ in p.top_k))
    click.echo(f"{'PATH':<{width}}  {'CLASS':<{cwidth}}  {'PROB':>7}  {'LATENCY':>10}")
    for pred, path in zip(predictions, paths):
        shown = path if len(path) <= width else "..." + path[-(width - 3):]
        for rank, (name, prob) in enumerate(pred.top_k):
            first = rank == 0
            latency = f"{pred.latency_ms:.1f} ms" if first else ""
            row = f"{shown if first else '':<{width}}  {name:<{cwidth}}  {100 * prob:6.2f}%  {latency:>10}"
            click.echo(row.rstrip())


def info_lines(report: dict[str, Any]) -> list[str]:
    from edge_client.check_images import check_words

    b, d = report["bundle"], report["device"]
    lines = [f"bundle:     {b['path']}"]
    if b.get("error"):
        lines.append(f"  error:    {b['error']}")
    if b.get("manifest"):
        classes = b.get("classes") or []
        shown = ", ".join(classes[:8]) + (", ..." if len(classes) > 8 else "")
        lines += [f"  round:    {b.get('round')} of run {b.get('run')}",
                  f"  model:    {b.get('model')}, precision {b.get('precision')}",
                  f"  classes:  {len(classes)} ({shown})",
                  f"  hashes:   {'OK' if b.get('hashes_ok') else 'FAILED'}"
                  + ("" if not b.get("hashes_ok") else ", class names checked against model.onnx"
                     if b.get("classes_pinned") else ", class names not pinned by model.onnx (re-export to pin them)"),
                  f"  LoRA:     {b.get('lora', {}).get('describe', '?')}",
                  f"  training: {'yes (edge-client train)' if b.get('trainable') else 'no (inference-only bundle)'}",
                  f"  checks:   {check_words(b.get('check_images'))} (what --runtime auto verifies on)",
                  f"  size:     {b.get('bytes', 0) / 1e6:.1f} MB"]
    lines.append(f"providers:  {', '.join(d['providers']) or 'onnxruntime not installed'}")
    lines.append("runtimes:   " + ", ".join(f"{name} {r['version']}" if r["available"] else f"{name} ({r['why']})"
                                          for name, r in d.get("runtimes", {}).items()))
    lines += requires_lines(report.get("requires"))
    chosen = report.get("runtime") or {}
    lines.append(f"error: {chosen['error']}" if chosen.get("error") else chosen.get("line", "runtime:   ?"))
    torch = d["torch"]
    if torch.get("installed"):
        cuda = ", ".join(f"{g['name']} ({g['free_gb']:.1f}/{g['total_gb']:.1f} GiB free)"
                         for g in torch.get("gpus", [])) or "no CUDA"
        lines.append(f"torch:      {torch.get('version')} ({cuda})")
    else:
        lines.append("torch:      not installed (inference works; `train` needs fedmvp[edge-train])")
    memory = d.get("memory_available_gb")
    lines.append(f"memory:     {memory:.1f} GiB available" if memory is not None else "memory:     unknown")
    lines.append(f"cpus:       {d.get('cpus')}")
    return lines


def requires_lines(requires: dict[str, Any] | None) -> list[str]:
    """The ``requires`` block: per file of the bundle whether this device's versions run it, and why not."""
    if not requires:
        return []
    if requires.get("error"):
        return [f"requires:   ? ({requires['error']})"]
    if not requires.get("recorded"):
        return ["requires:   not recorded (exported before fedmvp recorded what each file needs; nothing checked)"]
    lines = ["requires:   what each file needs, against this device's versions"]
    for role, status in requires.get("roles", {}).items():
        have = "; ".join(f"{p['needs']}: {p['installed'] or 'not installed'}" for p in status["packages"].values())
        verdict = "runs" if status["runs"] else "cannot run"
        lines.append(f"  {status['file']:<22} {verdict} ({role}; {have})")
    return lines
