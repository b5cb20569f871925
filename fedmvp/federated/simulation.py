"""`fedmvp train` on one machine: a run directory, then Flower's simulation engine.

Validation happens before anything starts (the preset and its data are checked, the
federation is built once here), so a bad preset costs one clear line, not a Ray start.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from fedmvp.runs import RunDir, RunError

FLOWER_QUIET_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0",
                    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}


def default_run_dir(preset_name: str) -> Path:
    return Path("runs") / f"{preset_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def prepare_run(preset_path: str, run_dir: str | None, rounds: int | None, resume: bool,
                device: str = "auto") -> RunDir:
    """Validate the preset, create or reopen the run directory, write config.json."""
    from fedmvp.data.federation import build_federation
    from fedmvp.presets import load_preset

    preset = load_preset(preset_path)
    federation = build_federation(preset)
    path = Path(run_dir) if run_dir else None
    if resume:
        if path is None:
            candidates = sorted(Path("runs").glob(f"{preset.name}-*"), key=lambda p: p.stat().st_mtime)
            if not candidates:
                raise RunError(f"runs/{preset.name}-*: nothing to resume")
            path = candidates[-1]
        run = RunDir(path)
        config = run.read_config()
        if rounds is not None and rounds != config["rounds"]:
            raise RunError(f"{run.path}: was started with {config['rounds']} rounds; resume keeps them")
        return run
    run = RunDir(path or default_run_dir(preset.name))
    if run.exists() and run.rounds():
        raise RunError(f"{run.path}: already holds rounds {run.rounds()[0]}..{run.rounds()[-1]}; "
                       f"pass --resume or another --run-dir")
    run.path.mkdir(parents=True, exist_ok=True)
    source = Path(getattr(preset, "path", preset_path))
    if source.is_file():
        shutil.copyfile(source, run.path / "preset.toml")
    dev = resolve_device(device)
    train = preset.train
    run.write_config({
        "preset": preset.name, "preset_path": str(source.resolve()) if source.is_file() else preset_path,
        "protocol": preset.protocol, "seed": preset.seed, "rounds": int(rounds or train.rounds),
        "lr": train.lr, "num_clients": len(federation.clients),
        "fraction": float(getattr(federation, "fraction_per_round", 1.0)),
        "model": {"clip": preset.model.clip, "pretrained": preset.model.pretrained},
        "train": {k: getattr(train, k) for k in vars(train)} if hasattr(train, "__dict__") else {},
        "client_device": dev, "server_device": dev, "central_eval": True,
    })
    return run


def simulate(run: RunDir, eval_every: int = 0, progress: bool = True, cpus: int | None = None) -> RunDir:
    """Run (or finish) the rounds of ``run`` on Flower's simulation engine."""
    os.environ.update(FLOWER_QUIET_ENV)
    from flwr.simulation import run_simulation

    from fedmvp.federated import server_app
    from fedmvp.federated.client_app import app as client_app

    config = run.read_config()
    cpus = cpus or max(1, min(os.cpu_count() or 1, int(config["num_clients"])))
    gpu = 0.0
    if config.get("client_device") == "cuda":
        gpu = 1.0 / cpus
    os.environ["FEDMVP_CLIENT_THREADS"] = str(max(1, (os.cpu_count() or 1) // cpus))
    server_app.SIMULATION_SETTINGS = server_app.ServerSettings(run_dir=str(run.path), eval_every=eval_every,
                                                               progress=progress)
    # Flower logs every round at INFO and warns that run_simulation is deprecated in favour of
    # `flwr run`; our progress bar and run directory say what happened, errors still print.
    logging.getLogger("flwr").setLevel(logging.ERROR)
    backend = {"client_resources": {"num_cpus": 1, "num_gpus": gpu},
               # Ray's workers inherit this process's environment (set above) at ray.init.
               "init_args": {"num_cpus": cpus, "log_to_driver": False, "logging_level": logging.ERROR,
                             "include_dashboard": False}}
    run_simulation(server_app=server_app.app, client_app=client_app, num_supernodes=int(config["num_clients"]),
                   backend_config=backend)
    done = run.last_round() or 0
    if done < int(config["rounds"]):
        raise RunError(f"{run.path}: stopped after round {done} of {config['rounds']} (see the log above); "
                       f"`fedmvp train --resume --run-dir {run.path}` continues")
    return run
