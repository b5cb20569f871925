"""`fedmvp train`: federated training of a preset on Flower's simulation engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from fedmvp.atomic import os_error_line
from fedmvp_apps.cli.common import BadInput, break_lock_option, echo_run_table, emit_json, quiet_open_clip_logging

if TYPE_CHECKING:
    from fedmvp.clip import LoadedClip
    from fedmvp.runs import RunDir


def train_or_resume(config: str, rounds: int | None, run_dir: str | None, resume: bool, eval_every: int,
                    device: str, progress: bool = True, command: str = "fedmvp train",
                    break_lock: bool = False) -> RunDir:
    """Shared by `train` and `demo`: validate, then simulate. Bad input raises BadInput.

    The run's lock (``RUN/.lock``, as ``command``) is held from before config.json is read or written
    (as soon as the run directory exists) until the simulation ended: an ingest or a second --resume
    meanwhile is refused with one line naming this process (exit 2). The ServerApp, which Flower's
    simulation runs in a thread of this process, takes it again re-entrantly. ``break_lock``: take over a
    lock whose record names another host (docs/security.md)."""
    from fedmvp.run_lock import RunLockError, lock_existing, run_lock
    from fedmvp_apps.deploy.stopping import end_at_signal

    from pathlib import Path

    # the run directory, once there is one (a resumed run's from the start): what a signal's line names
    started: list = [Path(run_dir)] if run_dir and Path(run_dir, "config.json").is_file() else []
    try:
        with end_at_signal(lambda signum: stopped_line(command, signum, started[0] if started else None)), \
                lock_existing(run_dir, command, break_lock):
            clip = None if resume else _backbone(config)  # before the run directory is written
            run = _prepare(config, rounds, run_dir, resume, device)
            started[:] = [run.path]
            check_vocabulary(run, clip)
            with run_lock(run.path, command, can_wait=False, break_lock=break_lock):
                return _simulate(run, eval_every, progress)
    except RunLockError as err:
        raise BadInput(str(err)) from None


def stopped_line(command: str, signum: int, run_dir) -> str:
    """The one line a signal ends `fedmvp train` / `fedmvp demo` with: what is kept, how to go on. Each
    round is written whole (docs/tutorials/one-machine.md, "Stopping and resuming")."""
    from fedmvp.runs import RunDir
    from fedmvp_apps.deploy.stopping import NAMES

    why = NAMES.get(signum, f"signal {signum}")
    if run_dir is None:
        return f"{command}: stopped by {why} before the run directory was written; nothing was kept"
    try:
        last = RunDir(run_dir).last_round()
    except Exception:  # noqa: BLE001 - the line must be printed whatever the run's files hold
        last = None
    kept = f"rounds up to {last} are kept" if last else "no round was complete yet"
    return (f"{command}: stopped by {why}; {kept} in {run_dir}; "
            f"`fedmvp train --resume --run-dir {run_dir}` continues")


def _prepare(config: str, rounds: int | None, run_dir: str | None, resume: bool, device: str) -> RunDir:
    """The run directory, created or reopened and checked (`prepare_run`); bad input raises BadInput."""
    from fedmvp.attributes.files import AttributeFileError
    from fedmvp.clip_errors import ClipLoadError
    from fedmvp.federated.prepare import prepare_run
    from fedmvp.presets.schema import PresetError
    from fedmvp.runs import RunError

    try:
        return prepare_run(config, run_dir, rounds, resume, device)
    except (PresetError, RunError, AttributeFileError, ClipLoadError) as err:
        raise BadInput(str(err)) from err
    except OSError as err:  # a missing file, a read-only or full disk (the run directory is probed first)
        raise BadInput(os_error_line(err)) from err


def _backbone(config: str) -> LoadedClip:
    """The preset's frozen CLIP, loaded before anything is written: weights that cannot load offline are
    bad input (one line, exit 2), not a simulation that fails."""
    from fedmvp.clip_errors import ClipLoadError
    from fedmvp.federated.prepare import check_startable
    from fedmvp.presets.schema import PresetError, load_preset
    from fedmvp.runs import RunError
    from fedmvp.vocabulary_check import load_backbone

    try:
        preset = load_preset(config, check_roots=False)
        check_startable(preset, simulation=True)  # the one refusal of a preset a run cannot start from
    except (PresetError, RunError) as err:
        raise BadInput(str(err)) from None
    try:
        return load_backbone(preset.model.clip, preset.model.pretrained, preset.seed)
    except ClipLoadError as err:
        raise BadInput(f"{preset.path}: [model]: {err}") from None


def check_vocabulary(run: RunDir, clip: LoadedClip | None = None) -> None:
    """Before any round: can the backbone tell the run's classes apart by text? One warning line if not,
    the figures in RUN/vocabulary.json (``fedmvp.vocabulary_check``). ``clip``: the run's backbone, if
    already loaded (a resumed run's is loaded here, from its record)."""
    from fedmvp.clip_errors import ClipLoadError
    from fedmvp.vocabulary_check import check_run, load_backbone

    try:
        clip = clip or load_backbone(*run.clip_spec(), run.seed)
    except ClipLoadError as err:
        raise BadInput(str(err)) from None
    check_run(run.path, run.class_set(), clip)


def _simulate(run: RunDir, eval_every: int, progress: bool) -> RunDir:
    """The rounds on Flower's simulation engine; a write that failed mid-run raises RunError."""
    from fedmvp.federated.simulation import simulate
    from fedmvp.runs import RunError
    from fedmvp_apps.watchdog import start_watchdog

    start_watchdog()  # Ray's helpers must not outlive a killed `fedmvp train` / `fedmvp demo`
    try:
        return simulate(run, eval_every=eval_every, progress=progress)
    except OSError as err:  # a write that failed mid-run (the rounds so far are whole: --resume)
        raise RunError(os_error_line(err)) from err


@click.command()
@click.option("--config", "config", required=True, metavar="PRESET",
              help="Preset name (demo, base2new, domainbed-pacs, imagenet-ssmt) or a TOML file.")
@click.option("--rounds", type=click.IntRange(min=1), default=None, help="Override the preset's rounds.")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="Run directory (default: runs/<preset>-<timestamp>).")
@click.option("--resume", is_flag=True, help="Continue the run in --run-dir (default: the preset's latest "
              "run) from its last complete round.")
@click.option("--eval-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Evaluate Local/Base/New/HM every N rounds (0: only after the last round).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@break_lock_option
@click.option("--json", "as_json", is_flag=True, help="Print the final metrics as JSON.")
def train(config: str, rounds: int | None, run_dir: str | None, resume: bool, eval_every: int, device: str,
          break_lock: bool, as_json: bool) -> None:
    """Train FedMVP across the preset's clients, one checkpoint per round.

    Each round every selected client trains the PromptFormer (or, once its mean loss
    fell below sigma, only the LoRA) on its own few-shot data; the server averages
    each tensor over the clients that sent it. Writes runs/<name>/ with config.json,
    round-NNNN/ checkpoints, metrics.jsonl/csv and accuracy.png, and ends with the
    Local/Base/New/HM table of the last round (as `fedmvp demo` does). A reply the server
    leaves out is one line as it happens (round, site, node, reason); Flower's and Ray's own
    warnings and errors go to RUN/flower.log, named at the end when there are any. Exit codes: 0 done,
    1 training failed (resume with --resume), 2 bad preset or arguments, or the run in use by
    another command (RUN/.lock: one line naming it; a dead holder's lock on this host is taken over, one
    whose record names another host only with --break-lock), or RUN/.lock a link."""
    quiet_open_clip_logging()
    from fedmvp.runs import RunError

    try:
        run = train_or_resume(config, rounds, run_dir, resume, eval_every, device, break_lock=break_lock)
        if as_json:
            from fedmvp.federated.metrics import population, recorded_counts
            from fedmvp.run_metrics import read_metrics
            from fedmvp.vocabulary_check import read_record
            final = (read_metrics(run) or [{}])[-1]
            counts = recorded_counts(final)  # what the final row is over (docs/method.md §7)
            emit_json({"run_dir": str(run.path), "final": final,
                       "population": None if counts is None else population(run.federation_record(), counts),
                       "vocabulary": read_record(run.path)})
            return
        from fedmvp.federated.evaluation import evaluate_run
        result = evaluate_run(run)
    except RunError as err:
        raise click.ClickException(str(err)) from err
    echo_run_table(result, run.path)  # the table `fedmvp demo` prints, and `fedmvp evaluate` for any round
