"""`fedmvp serve`: run a federation's server: a Flower SuperLink, the FedMVP run on it, progress."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from fedmvp_apps.cli.common import BadInput, FiniteFloat, break_lock_option, echo_run_table, emit_json, \
    quiet_open_clip_logging


@click.command()
@click.option("--config", "config", required=True, metavar="PRESET",
              help="Preset name or TOML file (validated here before anything starts).")
@click.option("--run-dir", required=True, type=click.Path(path_type=Path, file_okay=False),
              help="Run directory on this machine; the same command on an existing one resumes it.")
@click.option("--rounds", type=click.IntRange(min=1), default=None, help="Override the preset's rounds.")
@click.option("--min-nodes", type=click.IntRange(min=1), default=None,
              help="Replies a round needs (and nodes that must be connected); default: the preset's [server] "
                   "min_nodes, else every client (a [federation] without [[sites]]: every site sampled among "
                   "those connected, once one is).")
@click.option("--fraction", type=FiniteFloat(0, 1, min_open=True), default=None,
              help="Share of the connected nodes asked each round (default: the preset's fraction_fit).")
@click.option("--round-timeout", type=FiniteFloat(min=0, min_open=True), default=None,
              help="Seconds a round waits; then it closes with the replies it has if at least --min-nodes came.")
@click.option("--mode", type=click.Choice(["sync", "buffered"]), default=None,
              help="Override the preset's [server] mode for this start: 'buffered' trains the edge devices without "
                   "a barrier, a version every buffer_size updates (docs/howto/buffered.md); a run whose sites "
                   "trained synchronously continues with its devices.")
@click.option("--eval-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Evaluate every N rounds (0: only the last round).")
@click.option("--certs", "certs", type=click.Path(path_type=Path, file_okay=False), default=Path("certs"),
              show_default=True, help="Folder with ca.crt, server.pem, server.key (`fedmvp certs`).")
@click.option("--insecure", is_flag=True, help="No TLS: traffic in the clear, anyone may join. Trials only.")
@click.option("--node-keys", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Admit only the SuperNodes whose public keys this file lists (one OpenSSH line each). "
                   "Required with TLS unless --allow-any-node.")
@click.option("--allow-any-node", is_flag=True,
              help="With TLS and no --node-keys: admit any SuperNode that trusts the CA (a warning at start and "
                   "every round). Anyone holding ca.crt could then join and have replies averaged.")
@click.option("--address", default="0.0.0.0:9092", show_default=True,
              help="HOST:PORT the SuperLink listens on (SuperNodes and the CLI connect to this one port).")
@break_lock_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def serve(config: str, run_dir: Path, rounds: int | None, min_nodes: int | None, fraction: float | None,
          round_timeout: float | None, mode: str | None, eval_every: int, certs: Path, insecure: bool, node_keys: Path | None,
          allow_any_node: bool, address: str, break_lock: bool, as_json: bool) -> None:
    """Start a Flower SuperLink (TLS by default), submit the FedMVP run of PRESET to it, show
    progress and exit with the run, stopping the SuperLink. Sites join with `fedmvp join`.
    Only this command controls the SuperLink (its Control API takes an operator token that never
    leaves this machine; `flwr ls/run/stop` from elsewhere are refused), and with TLS only the
    SuperNodes whose keys --node-keys lists may join. Ctrl-C or SIGTERM stops the run, then the
    SuperLink, within 15 s, with one line.
    Offline: no runtime dependency installation, no telemetry. A reply the server leaves out is one
    line as it happens (round, site, node, reason); the ServerApp keeps Flower's warnings and errors in
    RUN/flower.log, named at the end when the run added to it. Without a terminal (a log file, a systemd
    unit) each round is one line as it completes: who replied, whose reply was left out and why, who
    timed out, the loss, an evaluated round's figures, its seconds (with --json on stderr, and in the
    JSON's round_log). A completed run ends with the results table `fedmvp train` prints (--json: final).
    Exit codes: 0 the run completed,
    1 it failed or stopped (start the same command again to resume), 2 bad arguments, or the run's
    lock (RUN/.lock) is held, or names a process on another host (--break-lock), or is a link."""
    quiet_open_clip_logging()
    from fedmvp_apps.deploy.certs import CertsError
    from fedmvp_apps.deploy.stopping import Interrupted
    from fedmvp_apps.deploy.superlink import ServeOptions, serve as run_serve
    from fedmvp_apps.deploy.supernode import LaunchError, LaunchInputError  # ServeError, ServeInputError too
    from fedmvp.presets.schema import PresetError, load_preset
    from fedmvp.runs import RunDir, RunError

    from fedmvp.clip_errors import ClipLoadError
    from fedmvp.vocabulary_check import check_preset, write_record

    try:
        preset = load_preset(config, check_roots=False)
        if not RunDir(run_dir).exists():  # a new run: what its ServerApp would only find once started
            from fedmvp.federated.prepare import check_startable  # (it loads CLIP; a resumed run needs not)

            check_startable(preset, simulation=False)
        vocabulary = check_preset(preset)  # the backbone tells the classes apart by text (one warning line if not)
    except (PresetError, RunError, ClipLoadError) as err:
        raise BadInput(str(err)) from None
    check_run_lock(run_dir, break_lock)
    check_resume(config, run_dir, rounds)
    if insecure:
        click.echo("warning: --insecure: no TLS, traffic is readable and anyone who reaches the port may join; "
                   "use it only for a trial", err=True)
    options = ServeOptions(preset=config, run_dir=run_dir, rounds=rounds, min_nodes=min_nodes, fraction=fraction,
                           round_timeout=round_timeout, mode=mode, eval_every=eval_every, certs=certs, insecure=insecure,
                           node_keys=node_keys, allow_any_node=allow_any_node, address=address)
    from fedmvp_apps.deploy.server_lines import RoundWatch, round_line

    bar = None
    if not as_json and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(desc="rounds", unit="round", file=sys.stderr)
    # no terminal (a log file, a systemd unit), or no bar: one line per round (--json: on stderr)
    lines, rounds, loss = as_json or bar is None or not sys.stdout.isatty(), RoundWatch(run_dir), ""

    def progress(done: int, status: str) -> None:
        nonlocal loss
        for record in rounds.new():
            if lines:
                click.echo(round_line(record), err=as_json)
            if isinstance(record["train_loss"], (int, float)):
                loss = f", loss {record['train_loss']:.3f}"
        if bar is not None:
            bar.n = done
            bar.set_postfix_str(status + loss)
            bar.refresh()

    try:
        status = run_serve(options, progress, on_event=lambda line: click.echo(f"serve: {line}", err=True))
    except (LaunchInputError, CertsError) as err:
        raise BadInput(str(err)) from None
    except LaunchError as err:
        raise click.ClickException(str(err)) from None
    except Interrupted as err:
        click.echo(f"serve: {err}", err=True)
        sys.exit(1)
    finally:
        if bar is not None:
            bar.close()

    write_record(run_dir, vocabulary)
    final = final_results(run_dir) if status == "finished:completed" else None
    result = {"run_dir": str(run_dir), "status": status, "rounds": RunDir(run_dir).rounds(),
              "vocabulary": vocabulary and vocabulary.record(), "round_log": RoundWatch(run_dir, 0).new(),
              "final": final}
    if as_json:
        emit_json(result)
    else:
        if final is not None:
            echo_run_table(final, run_dir)  # the table `fedmvp train` ends with, the warnings under it included
        click.echo(f"run {run_dir}: {status}, rounds {result['rounds'][-1] if result['rounds'] else 0}"
                   f"  (fedmvp evaluate --run {run_dir})")
    if status != "finished:completed":
        sys.exit(1)


def final_results(run_dir: Path) -> dict | None:
    """The last round's table figures (``evaluate_run``: what the sites reported when they evaluated it);
    None, with one warning line, where they cannot be had here (a round the sites did not evaluate and
    whose data this machine lacks): the run itself completed."""
    from fedmvp.federated.evaluation import evaluate_run
    from fedmvp.runs import RunDir

    try:
        return evaluate_run(RunDir(run_dir))
    except Exception as err:  # noqa: BLE001 - a missing data root, a round not evaluated: the run is done all the same
        click.echo(f"warning: no results table: {str(err).splitlines()[0] if str(err) else type(err).__name__} "
                   f"(fedmvp evaluate --run {run_dir})", err=True)
        return None


def check_run_lock(run_dir: Path, break_lock: bool) -> None:
    """Refuse now (exit 2) a run whose lock another command holds, or whose record names another host, or
    that is a link: the ServerApp, which takes the lock in a process of its own, would fail in round 1.
    With ``break_lock`` a record of another host is taken over here (and the lock released for it)."""
    from fedmvp.run_lock import lock_existing
    from fedmvp.runs import RunError

    try:
        with lock_existing(run_dir, "fedmvp serve", break_lock):
            pass
    except RunError as err:
        raise BadInput(str(err)) from None


def check_resume(config: str, run_dir: Path, rounds: int | None) -> None:
    """An existing run resumes with its own record: another preset or another --rounds is refused here, in
    one line, before anything starts (the ServerApp would refuse it too, as a traceback after the start).
    The same preset by another path (a copy, a link, a relative path) is the same preset: it resumes."""
    from fedmvp.federated.prepare import check_same_preset
    from fedmvp.runs import RunDir, RunError

    run = RunDir(run_dir)
    if not run.exists():
        return
    try:
        recorded = run.read_config()
        check_same_preset(run, recorded, config)
    except RunError as err:
        raise BadInput(str(err)) from None
    if rounds is not None and rounds != int(recorded.get("rounds", 0)):
        raise BadInput(f"{run_dir}: was started with {recorded.get('rounds')} rounds, not --rounds {rounds}; a "
                       f"resumed run keeps its rounds: drop --rounds (or give another --run-dir)")
