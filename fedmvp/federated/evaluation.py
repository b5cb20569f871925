"""The paper's evaluation (docs/method.md §7): Local / Base / New / HM (+ held-out domains) of a model.

``evaluate_global`` scores the global model (or the frozen CLIP, zero-shot, with the same
attribute classifier) on a task context; ``evaluate_run`` does it for a round of a run
directory, rebuilding the model from the run's method record; ``format_table`` prints the
paper's two-row table.
"""

from __future__ import annotations

import torch

from fedmvp.federated.task import Samples, TaskContext, task_context
from fedmvp.model import autocast_for
from fedmvp.runs import RunDir

COLUMNS = ("local", "base", "new", "hm")


def harmonic_mean(values: list[float]) -> float:
    if any(v <= 0 for v in values):
        return 0.0
    return len(values) / sum(1.0 / v for v in values)


def _mean(values: list[float]) -> float | None:
    return float(sum(values) / len(values)) if values else None


@torch.no_grad()
def accuracy(ctx: TaskContext, key: str, samples: Samples, text_features: torch.Tensor,
             prompted: bool = True, batch_size: int = 256) -> tuple[int, int]:
    """(correct, total) of the global model (or the frozen CLIP when ``prompted`` is False)."""
    model = ctx.model
    images, labels = ctx.images(key, samples)
    model.set_text_features(text_features)
    model.eval()
    correct = 0
    for start in range(0, len(images), batch_size):
        batch = images[start:start + batch_size].to(ctx.device)
        with autocast_for(ctx.device):
            feats = model.encode(batch) if prompted else model.encode_frozen(batch)
            logits = model.logits(feats.float())
        correct += int((logits.argmax(-1).cpu() == labels[start:start + batch_size]).sum())
    return correct, len(images)


def evaluate_global(ctx: TaskContext, global_state: dict[str, torch.Tensor] | None) -> dict[str, float | None]:
    """Local (each client on its own classes; mean over a dataset's clients, then over datasets),
    Base and New (label subsets, mean over datasets and domains), HM of the three, Domain.

    ``global_state`` None evaluates the frozen CLIP (zero-shot) with the same classifier."""
    prompted = global_state is not None
    if prompted:
        ctx.model.load_state(global_state)
        ctx.model.set_lora_mode(False)
    local: dict[str, list[float]] = {}
    for client in ctx.federation.clients:
        feats = ctx.text_features(client.class_names, client.attributes, client.style)
        c, n = accuracy(ctx, f"test/{client.client_id}", client.test, feats, prompted)
        if n:
            local.setdefault(client.dataset, []).append(c / n)
    results: dict[str, list[float]] = {"base": [], "new": [], "domain": []}
    for ev in ctx.federation.evaluations:
        feats = ctx.text_features(ev.class_names, ev.attributes, ev.style)
        c, n = accuracy(ctx, f"eval/{ev.kind}/{ev.dataset}/{ev.domain}", ev.samples, feats, prompted)
        if n:
            results[ev.kind].append(c / n)
    per_dataset = [m for m in (_mean(v) for v in local.values()) if m is not None]
    metrics = {"local": _mean(per_dataset), "base": _mean(results["base"]), "new": _mean(results["new"]),
               "domain": _mean(results["domain"])}
    parts = [metrics[k] for k in ("local", "base", "new") if metrics[k] is not None]
    metrics["hm"] = harmonic_mean(parts) if parts else None
    return metrics


def evaluate_run(run: RunDir, round_number: int | None = None) -> dict:
    """Zero-shot (frozen CLIP, same attribute classifier) and tuned metrics of one round."""
    from fedmvp.federated.prepare import run_method

    config = run.read_config()
    checkpoint = run.load_checkpoint(round_number)
    zero_shot = run.read_json("zero_shot.json")
    tuned = checkpoint.state.get("metrics", {})
    if zero_shot is None or tuned.get("hm") is None:
        ctx = task_context(config["preset_path"], run_method(run, checkpoint), config.get("server_device", "cpu"))
        if zero_shot is None:
            zero_shot = evaluate_global(ctx, None)
            run.write_json("zero_shot.json", zero_shot)
        if tuned.get("hm") is None:
            tuned = evaluate_global(ctx, checkpoint.tensors)
    return {"run": str(run.path), "round": checkpoint.round,
            "zero-shot": {k: zero_shot.get(k) for k in (*COLUMNS, "domain")},
            "tuned": {k: tuned.get(k) for k in (*COLUMNS, "domain")}}


def format_table(result: dict) -> str:
    """Rows zero-shot / tuned, columns Local, Base, New, HM (percent), then the held-out domain."""
    has_domain = any(result[row].get("domain") is not None for row in ("zero-shot", "tuned"))
    header = f"{'':<10} {'Local':>7} {'Base':>7} {'New':>7} {'HM':>7}" + (f" {'Domain':>8}" if has_domain else "")
    lines = [f"round {result['round']} of {result['run']}", header]
    for row in ("zero-shot", "tuned"):
        values = result[row]
        cells = " ".join(f"{100 * values[k]:7.2f}" if values.get(k) is not None else f"{'-':>7}" for k in COLUMNS)
        if has_domain:
            d = values.get("domain")
            cells += f" {100 * d:8.2f}" if d is not None else f" {'-':>8}"
        lines.append(f"{row:<10} {cells}")
    return "\n".join(lines)
