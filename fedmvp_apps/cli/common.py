"""Shared CLI plumbing: one-line errors with meaningful exit codes, JSON output."""

from __future__ import annotations

import math
from typing import Any

import click

from fedmvp_formats import strict_json

EXIT_OK = 0
EXIT_FAILED = 1  # the work ran and (part of) it failed
EXIT_BAD_INPUT = 2  # bad arguments, files or presets: nothing was done


class FiniteFloat(click.FloatRange):
    """A float flag that refuses nan and inf: no range check catches NaN (every comparison is false)."""

    name = "finite float"

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


class BadInput(click.ClickException):
    """A one-line error about the user's input; exit code 2."""

    exit_code = EXIT_BAD_INPUT

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


def break_lock_option(f: Any) -> Any:
    """``--break-lock``: the operator's word that the holder a run's lock names on another host is gone
    (docs/security.md, "A lock held on another host")."""
    return click.option("--break-lock", is_flag=True,
                        help="Take over the run's lock (RUN/.lock) when its record names a process on ANOTHER "
                             "host that you know is gone. flock cannot see other hosts' processes on a shared "
                             "file system, so without this flag such a lock is refused (exit 2, one line naming "
                             "host, pid and since). A dead holder on this host is taken over without it.")(f)


def site_folder_error(err: Exception) -> BadInput:
    """A site folder's problems (``fedmvp.data.site_folder.SiteFolderError``), one line each: how `fedmvp
    join --data` and `fedmvp evaluate --data` refuse a folder."""
    return BadInput("\nerror: ".join(getattr(err, "problems", None) or [str(err)]))


def emit_json(obj: Any) -> None:
    click.echo(strict_json.dumps(obj, indent=2, default=str))  # no NaN token: any JSON parser reads it


def echo_run_table(result: dict, run_path: Any) -> None:
    """How `fedmvp train` and `fedmvp demo` end: the paper's table of the last round and where the run
    is (one definition, so both print the same lines; ``result`` is ``evaluate_run``'s)."""
    from fedmvp.federated.evaluation import format_table

    click.echo("")
    click.echo(format_table(result))
    click.echo(f"\nrun directory: {run_path}  (metrics.csv, accuracy.png, round-NNNN/ checkpoints)")


def quiet_open_clip_logging() -> None:
    """open_clip logs a warning for every random-init model; the CLI says what it loads itself."""
    import logging

    logging.getLogger().setLevel(logging.ERROR)
