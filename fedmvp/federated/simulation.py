"""`fedmvp train` on one machine: a run directory, then Flower's simulation engine.

Validation happens before anything starts (``prepare_run`` checks the preset and its data and
builds the federation once), so a bad preset costs one clear line, not a Ray start.
"""

from __future__ import annotations

import logging
import os
import sys

from fedmvp.atomic import os_error_line
from fedmvp.federated.flower_log import FLOWER_LOG, flower_log
from fedmvp.federated.prepare import simulation_problem
from fedmvp.federated.ray_token import RayTokenError, ensure_ray_token
from fedmvp.runs import RunDir, RunError
from fedmvp.scoped import environment
from fedmvp_formats.flower_env import FLOWER_QUIET_ENV

# Flower's quiet environment (fedmvp_formats.flower_env) plus the simulation engine's own: Ray's.
# RAY_DISABLE_FAILURE_SIGNAL_HANDLER: Ray's native handler would take SIGTERM from the command (a crash dump,
# exit 134) before `fedmvp train` can stop with its one line (fedmvp_apps.deploy.stopping.end_at_signal).
SIMULATION_ENV = {**FLOWER_QUIET_ENV, "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0",
                  "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
                  "RAY_DISABLE_FAILURE_SIGNAL_HANDLER": "1"}


def simulate(run: RunDir, eval_every: int = 0, progress: bool = True, cpus: int | None = None,
             client_app=None) -> RunDir:
    """Run (or finish) the rounds of ``run`` on Flower's simulation engine (``client_app``: another
    ClientApp than fedmvp's, e.g. one that misbehaves, to see what the server does with it). The
    server is the deployment's: it samples sites, learns each node's site from its ``partition-id``
    and has the nodes evaluate; only the CPU share of each node (``cpus`` of them) is simulation's.
    ``SIMULATION_ENV`` is this process's environment while the rounds run (Ray's workers inherit it at
    ``ray.init``), and is put back as it was after (``fedmvp.scoped``); every Ray listener requires this
    process's token (``ray_token``)."""
    try:
        ensure_ray_token()  # every listener of the Ray cluster requires this process's token (ray_token)
    except RayTokenError as err:
        raise RunError(str(err)) from None
    with environment(SIMULATION_ENV):
        return _simulate(run, eval_every, progress, cpus, client_app)


def _simulate(run: RunDir, eval_every: int, progress: bool, cpus: int | None, client_app) -> RunDir:
    from flwr.simulation import run_simulation

    if client_app is None:
        from fedmvp.federated.client_app import app as client_app
    from fedmvp.federated.server_app import ServerSettings, server_app_for

    config = run.read_config()
    problem = simulation_problem(run.server())  # a resumed run's record (a new one: prepare_run checked it)
    if problem:
        raise RunError(f"{run.path}: {problem}")
    cpus = cpus or max(1, min(os.cpu_count() or 1, int(config["num_clients"])))
    gpu = 0.0
    if config.get("client_device") == "cuda":
        gpu = 1.0 / cpus
    threads = max(1, (os.cpu_count() or 1) // cpus)  # each node's share of this machine, sent in every message
    failures: list[BaseException] = []
    settings = ServerSettings(run_dir=str(run.path), eval_every=eval_every, progress=progress, client_threads=threads)
    server_app = server_app_for(settings, failures)
    backend = {"client_resources": {"num_cpus": 1, "num_gpus": gpu},
               # Ray's workers inherit this process's environment (SIMULATION_ENV) at ray.init; its driver
               # logs warnings, which flower_log keeps in the run directory.
               "init_args": {"num_cpus": cpus, "log_to_driver": False, "logging_level": logging.WARNING,
                             "include_dashboard": False}}
    # Flower logs every round at INFO and warns that run_simulation is deprecated in favour of `flwr run`:
    # the terminal keeps our progress bar, each left-out reply and errors; RUN/flower.log every warning.
    with flower_log(run.path, echo=_say, quiet_console=True) as kept:
        try:
            run_simulation(server_app=server_app, client_app=client_app,
                           num_supernodes=int(config["num_clients"]), backend_config=backend)
        finally:
            if kept.note:
                _say(kept.note)
    if failures:  # the server's own error, its lines kept (Flower would only log it, with a traceback)
        err = failures[0]
        raise RunError(os_error_line(err) if isinstance(err, OSError) else error_lines(err)) from err
    done = run.last_round() or 0
    if done < int(config["rounds"]):
        raise RunError(f"{run.path}: stopped after round {done} of {config['rounds']} (see the lines above and "
                       f"{run.path / FLOWER_LOG}); "
                       f"`fedmvp train --resume --run-dir {run.path}` continues")
    return run


def _say(line: str) -> None:
    """One line on stderr, above the progress bar (tqdm keeps the bar whole)."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)


def error_lines(err: BaseException) -> str:
    """An error's message with each line's spacing tidied: a failed round's summary line, then its
    left-out senders indented (``replies.round_failed``)."""
    lines = [" ".join(line.split()) for line in str(err).splitlines() if line.strip()]
    return "\n  ".join(lines) or repr(err)
