"""`fedmvp evaluate`: the paper-style table for a run."""

from __future__ import annotations

import click

from fedmvp_apps.cli.common import BadInput, emit_json, quiet_open_clip_logging


@click.command()
@click.option("--run", "run_dir", required=True, type=click.Path(file_okay=False), help="Run directory.")
@click.option("--round", "round_number", type=click.IntRange(min=1), default=None,
              help="Round to evaluate (default: the last complete round).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the table.")
def evaluate(run_dir: str, round_number: int | None, as_json: bool) -> None:
    """Local / Base / New / HM of zero-shot CLIP and of the tuned model.

    Local: each client on the test images of its own classes; Base / New: the global
    model on each dataset's base / new test classes; HM: harmonic mean of the three."""
    quiet_open_clip_logging()
    from fedmvp.federated.evaluation import evaluate_run, format_table
    from fedmvp.runs import RunDir, RunError

    try:
        result = evaluate_run(RunDir(run_dir), round_number)
    except RunError as err:
        raise BadInput(str(err)) from err
    emit_json(result) if as_json else click.echo(format_table(result))
