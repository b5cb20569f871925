"""The paper's table for a run: zero-shot and tuned Local / Base / New / HM (SPEC section 7)."""

from __future__ import annotations

from fedmvp.runs import RunDir

COLUMNS = ("local", "base", "new", "hm")


def evaluate_run(run: RunDir, round_number: int | None = None) -> dict:
    """Zero-shot (frozen CLIP, same attribute classifier) and tuned metrics of one round."""
    from fedmvp.federated.task import evaluate_global, task_context

    config = run.read_config()
    checkpoint = run.load_checkpoint(round_number)
    ctx = task_context(config["preset_path"], config.get("server_device", "cpu"))
    zero_shot = run.read_json("zero_shot.json")
    if zero_shot is None:
        zero_shot = evaluate_global(ctx, None)
        run.write_json("zero_shot.json", zero_shot)
    tuned = checkpoint.state.get("metrics", {})
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
