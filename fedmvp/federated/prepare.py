"""A run directory from a preset: shared by `fedmvp train` (simulation) and the deployed ServerApp.

Validation happens here, before any round starts: the preset and its data are checked and the
federation is built once, so a bad preset costs one clear line.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from fedmvp.runs import RunDir, RunError


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
    from fedmvp.presets.schema import load_preset

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
