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


Counts = dict[str, tuple[int, int]]  # set name ("local" or an evaluation set's name) -> (correct, total)


def evaluation_sites(record: dict) -> dict[str, int]:
    """Which site evaluates each evaluation set (run record ``federation``): the first site of the same
    dataset and domain, else of the same dataset, else site 0 (a test-only dataset). Each set is
    evaluated exactly once, so the federated numbers equal the central ones."""
    clients = sorted(record["clients"], key=lambda c: c["id"])
    sites = {}
    for ev in record["evaluations"]:
        same = [c["id"] for c in clients if c["dataset"] == ev["dataset"] and c["domain"] == ev["domain"]]
        dataset = [c["id"] for c in clients if c["dataset"] == ev["dataset"]]
        sites[ev["name"]] = (same or dataset or [0])[0]
    return sites


def site_counts(ctx: TaskContext, site: int, global_state: dict[str, torch.Tensor] | None,
                assignment: dict[str, int]) -> Counts:
    """What one site evaluates on its own data: its Local test set and the sets assigned to it.

    ``global_state`` None evaluates the frozen CLIP (zero-shot) with the same classifier."""
    prompted = global_state is not None
    if prompted:
        ctx.model.load_state(global_state)
        ctx.model.set_lora_mode(False)
    counts: Counts = {}
    client = ctx.client(site)
    feats = ctx.text_features(client.class_names, client.attributes, client.style)
    counts["local"] = accuracy(ctx, f"test/{client.client_id}", client.test, feats, prompted)
    for ev in ctx.federation.evaluations:
        if assignment.get(ev.name) == site:
            feats = ctx.text_features(ev.class_names, ev.attributes, ev.style)
            counts[ev.name] = accuracy(ctx, f"eval/{ev.kind}/{ev.dataset}/{ev.domain}", ev.samples, feats, prompted)
    return counts


def combine_counts(record: dict, counts_by_site: dict[int, Counts]) -> dict[str, float | None]:
    """Local (each site on its own classes; mean over a dataset's sites, then over datasets), Base and
    New (label subsets, mean over datasets and domains), HM of the three, Domain; from the sites'
    counts, whoever computed them (one process or the nodes of a federation)."""
    dataset_of = {c["id"]: c["dataset"] for c in record["clients"]}
    kind_of = {ev["name"]: ev["kind"] for ev in record["evaluations"]}
    local: dict[str, list[float]] = {}
    results: dict[str, list[float]] = {"base": [], "new": [], "domain": []}
    for site in sorted(counts_by_site):
        for name, (correct, total) in sorted(counts_by_site[site].items()):
            if not total:
                continue
            if name == "local":
                local.setdefault(dataset_of[site], []).append(correct / total)
            elif name in kind_of:
                results[kind_of[name]].append(correct / total)
    per_dataset = [m for m in (_mean(v) for v in local.values()) if m is not None]
    metrics = {"local": _mean(per_dataset), "base": _mean(results["base"]), "new": _mean(results["new"]),
               "domain": _mean(results["domain"])}
    parts = [metrics[k] for k in ("local", "base", "new") if metrics[k] is not None]
    metrics["hm"] = harmonic_mean(parts) if parts else None
    return metrics


def evaluate_global(ctx: TaskContext, global_state: dict[str, torch.Tensor] | None) -> dict[str, float | None]:
    """The paper's metrics of the global model (or zero-shot CLIP), every site evaluated here."""
    record = ctx.federation.record()
    assignment = evaluation_sites(record)
    counts = {c.client_id: site_counts(ctx, c.client_id, global_state, assignment) for c in ctx.federation.clients}
    return combine_counts(record, counts)


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
