"""`fedmvp evaluate`: the paper-style table for a run, or for a round on one site's folder."""

from __future__ import annotations

from pathlib import Path

import click

from fedmvp_apps.cli.common import BadInput, FiniteFloat, emit_json, quiet_open_clip_logging, site_folder_error


@click.command()
@click.option("--run", "run_dir", required=True, type=click.Path(file_okay=False), help="Run directory.")
@click.option("--round", "round_number", type=click.IntRange(min=1), default=None,
              help="Round to evaluate (default: the last complete round).")
@click.option("--data", type=click.Path(path_type=Path), default=None,
              help="A [federation] run: evaluate on this site's folder DIR/<class>/<image> (or DIR/train + "
                   "DIR/test), its held-out share as `fedmvp join --data` splits it.")
@click.option("--name", default=None,
              help="With --data: the site's name (default: as `fedmvp join` names a site, this host's name; a run "
                   "whose preset lists [[sites]]: one of them, the folder's name or this host's).")
@click.option("--eval-fraction", type=FiniteFloat(0, 1, min_open=True, max_open=True), default=None,
              help="With --data: share of each class kept for evaluation (default: the preset's eval_fraction, "
                   "0.2; the site's `fedmvp join --eval-fraction`).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the table.")
def evaluate(run_dir: str, round_number: int | None, data: Path | None, name: str | None,
             eval_fraction: float | None, as_json: bool) -> None:
    """Local / Base / New / HM of zero-shot CLIP and of the tuned model.

    Local: each client on the test images of its own classes; Base / New: the global
    model on each dataset's base / new test classes; HM: harmonic mean of the three.
    An open federation's server holds no site data: a round its sites did not evaluate
    is evaluated with --data on one site's folder, as that site evaluates a deployed round
    (both rows on that folder, with its counts in --json)."""
    quiet_open_clip_logging()
    from fedmvp.data.site_folder import SiteFolderError
    from fedmvp.federated.evaluation import evaluate_run, format_table
    from fedmvp.federated.folder_evaluation import evaluate_folder
    from fedmvp.presets.schema import PresetError
    from fedmvp.runs import RunDir, RunError

    if data is None and (name is not None or eval_fraction is not None):
        raise BadInput("--name and --eval-fraction describe a site's folder: give it with --data DIR")
    try:
        if data is None:
            result = evaluate_run(RunDir(run_dir), round_number)
        else:
            result = evaluate_folder(RunDir(run_dir), round_number, data, name, eval_fraction)
    except SiteFolderError as err:
        raise site_folder_error(err) from None
    except (RunError, PresetError) as err:
        raise BadInput(str(err)) from err
    from fedmvp.vocabulary_check import read_record, recorded_warning

    vocabulary = read_record(run_dir)  # measured when the run started (fedmvp.vocabulary_check)
    if recorded_warning(vocabulary):
        click.echo(f"warning: {recorded_warning(vocabulary)}", err=True)
    emit_json({**result, "vocabulary": vocabulary}) if as_json else click.echo(format_table(result))
