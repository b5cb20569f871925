"""`fedmvp ingest`: update files of devices that synced late become the run's next round."""

from __future__ import annotations

import math
import sys

import click

from fedmvp_apps.cli.common import EXIT_FAILED, BadInput, FiniteFloat, break_lock_option, emit_json


@click.command()
@click.option("--run", "run_dir", required=True, type=click.Path(file_okay=False), help="Run directory.")
@click.argument("updates", nargs=-1, metavar="UPDATE...", type=click.Path(dir_okay=False))
@click.option("--max-staleness", type=click.IntRange(min=0), default=None,
              help="Rounds an update's bundle may be behind the run's last round "
                   "(default: the run's [server] max_staleness, else 5).")
@click.option("--wait", is_flag=True,
              help="When another command holds the run's lock (RUN/.lock: another ingest, a live training), "
                   "wait for it and then build on the round it wrote, instead of exiting 2.")
@click.option("--wait-timeout", type=FiniteFloat(min=0), default=None, metavar="SECONDS",
              help="Wait at most this long for the run's lock, then exit 2 (implies --wait).")
@break_lock_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def ingest(run_dir: str, updates: tuple[str, ...], max_staleness: int | None, wait: bool,
           wait_timeout: float | None, break_lock: bool, as_json: bool) -> None:
    """Average edge update files into the run's next round.

    For devices that trained with `edge-client train --data local/` and sync their update
    files later. Each file is checked against the run's last round R: the update format,
    exactly round R's LoRA names and shapes (float32, finite), num_examples (1 to
    [server] edge_max_examples), its bundle's round (R - max_staleness to R), the run_id
    it names, [server] max_update_norm (measured from its bundle's round), and not a file
    accepted before. Each accepted file is a delta against the LoRA of its bundle's round;
    round R+1's LoRA is round R's plus [server] server_lr times the example-weighted mean
    of those deltas, each discounted by s(t) = (1+t)^-staleness_exponent for a bundle t
    rounds behind R (every file fresh: FedAvg, as before); a robust [server] update_rule
    replaces that mean (docs/howto/robust.md). Under [privacy] the round's
    epsilon is charged first; a round past max_epsilon is refused (exit 2). Round R's
    other tensors stay unchanged; a rejected file changes nothing. It never overlaps another writer of the run
    (another ingest, a live `fedmvp train` or Flower server): it exits 2 naming the holder
    (pid, host, since), or with --wait builds on the round the holder wrote last.

    Exit codes: 0 a round was written, 1 no file was accepted (nothing written),
    2 bad input (no run, no complete round, no files) or the run is locked by another command."""
    from fedmvp.federated.ingest import ingest as ingest_files
    from fedmvp.runs import RunError

    if not updates:
        raise BadInput(f"{run_dir}: no update files given (UPDATE...: the files `edge-client train` wrote)")
    try:
        patience = wait_timeout if wait_timeout is not None else math.inf if wait else 0.0
        result = ingest_files(run_dir, updates, max_staleness=max_staleness, wait=patience, break_lock=break_lock)
    except RunError as err:
        raise BadInput(str(err)) from None
    except OSError as err:
        raise click.ClickException(f"{err.filename or run_dir}: cannot write ({err.strerror or err})") from None
    if as_json:
        emit_json(result.to_json())
    else:
        click.echo(format_table(result))
    if result.round is None:
        sys.exit(EXIT_FAILED)


def format_table(result) -> str:
    """file | accepted/rejected | reason, then one line saying what was written. A device names its
    file: a name with a newline or an escape sequence is shown escaped, so each file stays one row."""
    rows = [(v.file if v.file.isprintable() else repr(v.file), "accepted" if v.accepted else "rejected",
             v.reason or (f"update norm {v.clipped_from:.4g} clipped" if v.clipped_from is not None else ""))
            for v in result.files]
    width = max([len("file")] + [len(r[0]) for r in rows])
    lines = [f"{'file':<{width}}  {'result':<8}  reason"]
    lines += [f"{f:<{width}}  {outcome:<8}  {reason}".rstrip() for f, outcome, reason in rows]
    if result.round is None:
        lines.append(f"nothing written: none of {len(result.files)} files accepted "
                     f"(the run stays at round {result.base_round})")
    else:
        lines.append(f"round {result.round} written: {len(result.accepted)} of {len(result.files)} updates, "
                     f"{result.examples} examples, mean loss {result.mean_loss:.4g}  "
                     f"(fedmvp-export --run {result.run} --round {result.round})")
    return "\n".join(lines)
