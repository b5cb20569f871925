"""`fedmvp train` on one machine: a run directory, then Flower's simulation engine.

Validation happens before anything starts (``prepare_run`` checks the preset and its data and
builds the federation once), so a bad preset costs one clear line, not a Ray start.
"""

from __future__ import annotations

import logging
import os

from fedmvp.atomic import os_error_line
from fedmvp.runs import RunDir, RunError
from fedmvp_formats.flower_env import FLOWER_QUIET_ENV

# Flower's quiet environment (fedmvp_formats.flower_env) plus the simulation engine's own: Ray's.
SIMULATION_ENV = {**FLOWER_QUIET_ENV, "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0",
                  "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}


def simulate(run: RunDir, eval_every: int = 0, progress: bool = True, cpus: int | None = None,
             client_app=None) -> RunDir:
    """Run (or finish) the rounds of ``run`` on Flower's simulation engine (``client_app``: another
    ClientApp than fedmvp's, e.g. one that misbehaves, to see what the server does with it). The
    server is the deployment's: it samples sites, learns each node's site from its ``partition-id``
    and has the nodes evaluate; only the CPU share of each node (``cpus`` of them) is simulation's."""
    os.environ.update(SIMULATION_ENV)
    from flwr.simulation import run_simulation

    if client_app is None:
        from fedmvp.federated.client_app import app as client_app
    from fedmvp.federated.server_app import ServerSettings, server_app_for

    config = run.read_config()
    if run.server().mode == "buffered":  # buffered versions are trained by edge devices, which a simulation lacks
        raise RunError(f"{run.path}: [server] mode = 'buffered' trains on edge devices (`edge-client join`); "
                       f"run it with `fedmvp serve`, or use mode = 'sync' here")
    cpus = cpus or max(1, min(os.cpu_count() or 1, int(config["num_clients"])))
    gpu = 0.0
    if config.get("client_device") == "cuda":
        gpu = 1.0 / cpus
    threads = max(1, (os.cpu_count() or 1) // cpus)  # each node's share of this machine, sent in every message
    failures: list[BaseException] = []
    settings = ServerSettings(run_dir=str(run.path), eval_every=eval_every, progress=progress, client_threads=threads)
    server_app = server_app_for(settings, failures)
    # Flower logs every round at INFO and warns that run_simulation is deprecated in favour of
    # `flwr run`; our progress bar and run directory say what happened, errors still print.
    logging.getLogger("flwr").setLevel(logging.ERROR)
    backend = {"client_resources": {"num_cpus": 1, "num_gpus": gpu},
               # Ray's workers inherit this process's environment (set above) at ray.init.
               "init_args": {"num_cpus": cpus, "log_to_driver": False, "logging_level": logging.ERROR,
                             "include_dashboard": False}}
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=int(config["num_clients"]),
                   backend_config=backend)
    if failures:  # the server's own error, as one line (Flower would only log it, with a traceback)
        err = failures[0]
        line = os_error_line(err) if isinstance(err, OSError) else " ".join(str(err).split()) or repr(err)
        raise RunError(line) from err
    done = run.last_round() or 0
    if done < int(config["rounds"]):
        raise RunError(f"{run.path}: stopped after round {done} of {config['rounds']} (see the log above); "
                       f"`fedmvp train --resume --run-dir {run.path}` continues")
    return run
