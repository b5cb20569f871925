"""`fedmvp region-start` / `fedmvp region-update`: regional runs that feed one central run."""

from __future__ import annotations

import click

from fedmvp_apps.cli.common import BadInput, emit_json


@click.command("region-start")
@click.option("--central", "central", required=True, type=click.Path(file_okay=False),
              help="The central run directory the region starts from.")
@click.option("--round", "round_number", type=click.IntRange(min=0), default=None,
              help="The central round to start from (default: its last complete round).")
@click.option("--rounds", "rounds", type=click.IntRange(min=1), default=None,
              help="Rounds (buffered: versions) the region serves after that round: its config.json rounds is "
                   "ROUND + this (default: the central run's rounds).")
@click.option("--out", required=True, type=click.Path(), help="The region's new run directory (must not exist).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a line.")
def region_start(central: str, round_number: int | None, rounds: int | None, out: str, as_json: bool) -> None:
    """Make a regional run from a central run's round.

    The region gets the central run's records (config.json with a run id of its own,
    classes.json, preset.toml) and the round's folder bit for bit, plus OUT/region.json:
    the central run's id, the round, the sha256 of its global.safetensors, its PromptFormer
    digest, the central [server] edge_max_examples and --rounds. Train the region with any
    run kind: devices' update files with `fedmvp ingest --run OUT`, or a served federation
    resumed on OUT (`fedmvp serve --config PRESET --run-dir OUT --mode buffered`, PRESET the
    central run's preset; it writes rounds ROUND+1..ROUND+--rounds, devices join with bundles
    exported from OUT). `fedmvp region-update` then turns its progress into one update file
    for the central run's `fedmvp ingest`. Exit codes: 0 written, 2 bad input (no central
    run or round, a round without LoRA, OUT exists)."""
    from fedmvp.federated.regions import region_start as start
    from fedmvp.runs import RunError

    try:
        link = start(central, out, round_number, rounds)
    except RunError as err:
        raise BadInput(str(err)) from None
    except OSError as err:
        raise click.ClickException(f"{err.filename or out}: cannot write ({err.strerror or err})") from None
    if as_json:
        emit_json({"region": out, **link.to_json()})
    else:
        click.echo(f"region {out} starts from round {link.central_round} of {central} "
                   f"(checkpoint {link.checkpoint_sha256[:12]}) for {link.rounds} rounds; train it, then "
                   f"`fedmvp region-update --run {out}`")


@click.command("region-update")
@click.option("--run", "run_dir", required=True, type=click.Path(file_okay=False),
              help="The region's run directory (made by `fedmvp region-start`).")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="The update file to write.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a line.")
def region_update(run_dir: str, out: str, as_json: bool) -> None:
    """Write a region's progress as one update file for the central run.

    The file holds the region's last round's LoRA; the central `fedmvp ingest` takes its
    delta against the central round the region started from (RUN/region.json; the
    region's copy of it must still be that checkpoint, by sha256), so the delta is the
    region's last round minus that round. num_examples is the examples of every device
    update the region's rounds since took (their state.json), mean_loss their
    example-weighted train_loss. It names the central run (run_id), round
    (bundle_round), PromptFormer and class set: ingest checks it like a device's file.
    Refused (exit 2, nothing written): not a region, no round since the start, the
    PromptFormer moved (a file carries only the LoRA), or more examples than the central
    [server] edge_max_examples (raise it in the central preset: ingest would reject the
    file). Written atomically."""
    from fedmvp.federated.regions import region_update as update
    from fedmvp.runs import RunError

    try:
        result = update(run_dir, out)
    except RunError as err:
        raise BadInput(str(err)) from None
    except OSError as err:
        raise click.ClickException(f"{err.filename or out}: cannot write ({err.strerror or err})") from None
    if as_json:
        emit_json(result.to_json())
    else:
        click.echo(f"{out} written: region rounds {result.rounds[0]}-{result.rounds[-1]} since central round "
                   f"{result.central_round}, {result.examples} examples, delta norm {result.delta_norm:.4g}  "
                   f"(fedmvp ingest --run CENTRAL {out})")
