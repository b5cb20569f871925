"""A run directory from a preset: shared by `fedmvp train` (simulation) and the deployed ServerApp.

Validation happens here, before any round starts: the preset and its data are checked and the
federation is built (once per process, ``load_federation``), so a bad preset costs one clear
line. config.json is the run's record: the method config the model is built as (``method``),
the training settings, and what later readers need of the federation (client count, each
client's and evaluation's classes), so none of them rebuilds those from defaults or shapes.
"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from fedmvp.model import FedMVPConfig
from fedmvp.runs import Checkpoint, RunDir, RunError

RECORD_VERSION = 2


def default_run_dir(preset_name: str) -> Path:
    return Path("runs") / f"{preset_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def method_config(train: Any) -> FedMVPConfig:
    """The model's method config from a preset's [train] table (the keys that shape the model)."""
    return FedMVPConfig(num_prompts=train.num_prompts, alpha=train.alpha, use_lora=train.use_lora,
                        lora_rank=train.lora_rank)


def run_method(run: RunDir, checkpoint: Checkpoint | None = None) -> FedMVPConfig:
    """The method config a run's weights were trained as: the round's own record, else config.json's."""
    record = (checkpoint.state.get("method") if checkpoint is not None else None) or run.read_config().get("method")
    where = run.round_path(checkpoint.round) / "state.json" if checkpoint is not None and \
        checkpoint.state.get("method") else run.config_path
    if record is None:
        raise RunError(f"{where}: no method record (a run made by an older fedmvp); train it again")
    try:
        return FedMVPConfig.from_dict(record, str(where))
    except ValueError as err:
        raise RunError(str(err)) from None


def prepare_run(preset_path: str, run_dir: str | None, rounds: int | None, resume: bool,
                device: str = "auto", with_data: bool = True) -> RunDir:
    """Validate the preset, create or reopen the run directory, write config.json.

    ``with_data=False`` (the server of a federation across machines): the federation's shape comes
    from class lists alone (``plan_record``), so this machine needs none of the sites' images."""
    if with_data:
        from fedmvp.data.federation import load_federation

        preset, federation = load_federation(preset_path)
        record = federation.record()
    else:
        from fedmvp.data.federation_plan import plan_record
        from fedmvp.presets.schema import load_preset

        preset = load_preset(preset_path, check_roots=False)
        record = plan_record(preset)
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
        run_method(run)  # refuses a run without a usable method record before anything starts
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
        "record_version": RECORD_VERSION, "run_id": uuid.uuid4().hex,
        "preset": preset.name, "preset_path": str(source.resolve()) if source.is_file() else preset_path,
        "protocol": preset.protocol, "seed": preset.seed, "rounds": int(rounds or train.rounds),
        "lr": train.lr, "num_clients": len(record["clients"]),
        "fraction": float(train.fraction_fit),
        "model": {"clip": preset.model.clip, "pretrained": preset.model.pretrained},
        "method": method_config(train).to_dict(),
        "train": dict(vars(train)),
        "server": dict(vars(preset.server)),
        "federation": record,
        "client_device": dev, "server_device": dev,
    })
    return run
