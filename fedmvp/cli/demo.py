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
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def demo(rounds: int | None, run_dir: str | None, config: str, as_json: bool) -> None:
    """Federated FedMVP on the embedded world, then the Local/Base/New/HM table."""
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
    if as_json:
        emit_json(result)
        return
    click.echo("")
    click.echo(format_table(result))
    click.echo(f"\nrun directory: {run.path}  (metrics.csv, accuracy.png, round-NNNN/ checkpoints)")
