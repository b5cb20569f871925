"""`fedmvp demo`: the whole flow on the embedded synthetic world, offline, in minutes.

Trains the `demo` preset (base classes cut into clients, new classes and one domain
held out) on Flower's simulation engine, writes ./runs/demo-<time>/ like any run, and
prints the paper-style table: zero-shot vs tuned Local / Base / New / HM.
"""

from __future__ import annotations

import click

from fedmvp.cli.common import BadInput, emit_json, quiet_open_clip_logging


@click.command()
@click.option("--rounds", type=click.IntRange(min=1), default=None, help="Override the demo preset's rounds.")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="Run directory (default: runs/demo-<timestamp>).")
@click.option("--config", default="demo", show_default=True, help="Preset to demonstrate.")
@click.option("--edge/--no-edge", default=True, show_default=True,
              help="Also export the last round and run the edge client (infer, then LoRA training).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def demo(rounds: int | None, run_dir: str | None, config: str, edge: bool, as_json: bool) -> None:
    """The whole flow on the embedded world, offline: federated training on Flower, the
    paper's Local/Base/New/HM table, an ONNX bundle of the last round, and the edge
    client classifying held-out new-class images before and after on-device LoRA
    training."""
    quiet_open_clip_logging()
    from fedmvp.cli.train import train_or_resume
    from fedmvp.evaluation import evaluate_run, format_table
    from fedmvp.runs import RunError

    try:
        run = train_or_resume(config, rounds, run_dir, resume=False, eval_every=0, device="auto")
        result = evaluate_run(run)
    except RunError as err:
        raise click.ClickException(str(err)) from err
    except BadInput:
        raise
    edge_result = None
    if edge:
        from fedmvp.demo_edge import run_edge_demo

        edge_result = run_edge_demo(run)
    if as_json:
        from dataclasses import asdict

        emit_json({**result, "edge": asdict(edge_result) if edge_result else None})
        return
    click.echo("")
    click.echo(format_table(result))
    click.echo(f"\nrun directory: {run.path}  (metrics.csv, accuracy.png, round-NNNN/ checkpoints)")
    if edge_result:
        pct = lambda v: f"{100 * v:.2f}%" if v is not None else "-"  # noqa: E731
        click.echo(f"bundle: {edge_result.bundle} ({edge_result.bundle_mb:.2f} MB)")
        for line in edge_result.parity:
            click.echo(line)
        click.echo(f"edge-client infer on held-out images of {len(edge_result.classes)} new classes: "
                   f"{pct(edge_result.before)} top-1")
        click.echo(f"edge-client train on {edge_result.train_examples} local images (LoRA only, "
                   f"{edge_result.recipe}, loss {edge_result.train_loss[0]:.3f} -> {edge_result.train_loss[1]:.3f}): "
                   f"{pct(edge_result.after)} top-1 after")
