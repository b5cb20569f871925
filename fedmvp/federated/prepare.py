"""Create (or reopen) a run directory from a preset: shared by `fedmvp train` (simulation) and the
deployed ServerApp. Readers of an existing run ask ``RunDir`` (its method, preset, federation, server
rules) and ``FedMVP.from_run`` (its model); this module only writes the record.

Validation happens here, before any round starts: the preset and its data are checked and the
federation is built (once per process, ``load_federation``), so a bad preset costs one clear
line. config.json is the run's record: the method config the model is built as (``method``),
the training settings, and what later readers need of the federation (client count, each
client's and evaluation's classes), so none of them rebuilds those from defaults or shapes.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedmvp import atomic
from fedmvp.presets.schema import method_keys
from fedmvp.run_classes import class_set_classes, federation_classes, write_classes
from fedmvp.runs import RunDir, RunError, recorded_copy

if TYPE_CHECKING:  # the model (torch, open_clip, peft) only where a config is built: `fedmvp serve`
    from fedmvp.model import FedMVPConfig  # resuming a run checks its record without them

RECORD_VERSION = 2


def default_run_dir(preset_name: str) -> Path:
    return Path("runs") / f"{preset_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def method_config(train: Any) -> FedMVPConfig:
    """The model's method config from a preset's [train] table: every key the schema marks as a method
    field (``presets.schema.method_keys``); the record's other fields keep their defaults."""
    from fedmvp.model import FedMVPConfig

    return FedMVPConfig(**{name: getattr(train, key) for key, name in method_keys().items()})


def check_startable(preset: Any, simulation: bool) -> None:
    """What a started run would otherwise find only once its directory is written (RunError naming the
    preset, exit 2 with nothing written): the CLIP round 0 builds, for the simulation its server mode, for a
    deployment each site's node_key (fedmvp.federated.site_keys), and [server] update_rule and device_rule registered rules
    (update_rules.py; checked here, in the server's process, where rules from outside the package are registered)."""
    from fedmvp.clip import ClipLoadError, check_clip
    from fedmvp.federated.update_rules import unknown_rule_problem

    problem = unknown_rule_problem(preset.server)
    if problem:
        raise RunError(f"{preset.path}: {problem}")

    try:
        check_clip(preset.model.clip, preset.model.pretrained)
    except ClipLoadError as err:
        raise RunError(f"{preset.path}: [model]: {err}") from None
    problem = simulation_problem(preset.server) if simulation else None
    if problem:
        raise RunError(f"{preset.path}: {problem}")
    if not simulation and preset.federation is not None:  # each [[sites]] node_key the nodes must prove
        from fedmvp.federated.site_keys import SiteKeyError, SiteKeys

        try:
            SiteKeys.from_preset(preset)
        except SiteKeyError as err:
            raise RunError(f"{preset.path}: {err}") from None


def simulation_problem(server: Any) -> str | None:
    """Why `fedmvp train` cannot run these server rules (None: it can)."""
    if server.mode == "buffered":  # buffered versions are trained by edge devices, which a simulation lacks
        return ("[server] mode = 'buffered' trains on edge devices (`edge-client join`); run it with `fedmvp serve`, "
                "or use mode = 'sync' here")
    return None


def check_same_preset(run: RunDir, config: dict[str, Any], given: str) -> None:
    """Resuming with another preset than the run's is refused (RunError): its rounds would mix settings.
    The original path itself is fine even if edited since (``RunDir.preset_file`` then warns and uses the record)."""
    from fedmvp.presets.schema import preset_path

    path = Path(preset_path(given))
    original = Path(str(config.get("preset_path", "")))
    if path.resolve() == original.resolve():
        return
    text = config.get("preset_text")
    try:
        same = isinstance(text, str) and path.read_text(encoding="utf-8") == text
    except (OSError, UnicodeDecodeError):
        same = False
    if not same:
        raise RunError(f"{path}: not the preset {run.path} was started with ({original}, recorded in "
                       f"{run.config_path}); resume with --config {original} or use another --run-dir")


def _resume(preset_arg: str, run_dir: str | None, rounds: int | None, with_data: bool) -> RunDir:
    """Reopen a run from its own record; nothing of the given preset but its identity is used."""
    from fedmvp.presets.schema import load_preset

    if run_dir:
        path = Path(run_dir)
    else:
        name = load_preset(preset_arg, check_roots=False).name
        candidates = sorted(Path("runs").glob(f"{name}-*"), key=lambda p: p.stat().st_mtime)
        if not candidates:
            raise RunError(f"runs/{name}-*: nothing to resume")
        path = candidates[-1]
    run = RunDir(path)
    config = run.read_config()
    if rounds is not None and rounds != config.get("rounds"):
        raise RunError(f"{run.path}: was started with {config.get('rounds')} rounds; resume keeps them")
    check_same_preset(run, config, preset_arg)
    effective = run.preset_file(config)
    if with_data:
        from fedmvp.data.federation import load_federation

        load_federation(effective)  # the recorded preset and its data, checked before anything starts
    else:
        load_preset(effective, check_roots=False)
    run.method()  # refuses a run without a usable method record before anything starts
    last = run.last_round()
    if last is not None:
        try:
            run.load_checkpoint(last)
        except RunError as err:
            before = [r for r in run.rounds() if r < last]
            folder = run.round_path(last)
            hint = (f"; move it aside (mv {folder} {folder}.corrupt) to resume from round {before[-1]}" if before
                    else f"; move it aside (mv {folder} {folder}.corrupt) to start over from round 1")
            raise RunError(f"{err}{hint}") from None
    return run


def prepare_run(preset_path: str, run_dir: str | None, rounds: int | None, resume: bool,
                device: str = "auto", with_data: bool = True) -> RunDir:
    """Validate the preset, create or reopen the run directory, write config.json.

    ``with_data=False`` (the server of a federation across machines): the federation's shape comes
    from class lists alone (``plan_record``), so this machine needs none of the sites' images; an open
    federation (no [[sites]]) records no site yet: its server numbers them as they join (``site_registry``).
    config.json records the preset's text and sha256: a resumed run uses that record (``RunDir.preset_file``)."""
    if resume:
        return _resume(preset_path, run_dir, rounds, with_data)
    if with_data:
        from fedmvp.data.federation import load_federation

        preset, federation = load_federation(preset_path)
        record = federation.record()
        classes = federation_classes(federation) if preset.federation is None else class_set_classes(preset)
    else:
        from fedmvp.data.federation_plan import plan_record
        from fedmvp.presets.schema import load_preset

        preset = load_preset(preset_path, check_roots=False)
        record = plan_record(preset)
        # a [federation]'s class set is its attribute file (no image needed); a [[datasets]] preset's
        # phrases come with its data: without it an export migrates (docs/architecture.md)
        classes = class_set_classes(preset) if preset.federation is not None else None
    check_startable(preset, simulation=with_data)  # with the sites' data: `fedmvp train`'s simulation
    run = RunDir(Path(run_dir) if run_dir else default_run_dir(preset.name))
    if run.exists() and run.rounds():
        raise RunError(f"{run.path}: already holds rounds {run.rounds()[0]}..{run.rounds()[-1]}; "
                       f"pass --resume or another --run-dir")
    if run.path.exists() and not run.path.is_dir():
        raise RunError(f"{run.path}: not a directory")
    atomic.probe_writable(run.path)
    source = Path(getattr(preset, "path", preset_path))
    text = source.read_bytes()
    atomic.write_text(run.preset_copy_path, recorded_copy(text.decode("utf-8"), source.parent.resolve()))
    dev = resolve_device(device)
    train = preset.train
    run.write_config({
        "record_version": RECORD_VERSION, "run_id": uuid.uuid4().hex,
        "preset": preset.name, "preset_path": str(source.resolve()),
        "preset_dir": str(source.parent.resolve()),
        "preset_sha256": hashlib.sha256(text).hexdigest(), "preset_text": text.decode("utf-8"),
        "protocol": preset.protocol, "seed": preset.seed, "rounds": int(rounds or train.rounds),
        "lr": train.lr, "num_clients": len(record["clients"]),
        "fraction": float(train.fraction_fit),
        "model": {"clip": preset.model.clip, "pretrained": preset.model.pretrained},
        "method": method_config(train).to_dict(),
        "train": dict(vars(train)),
        "server": preset.server.record(),
        **({"privacy": preset.privacy.record()} if preset.privacy is not None else {}),
        "federation": record,
        "client_device": dev, "server_device": dev,
    })
    if classes is not None:  # what an export bakes in, so the run alone can be exported
        write_classes(run.path, classes)
    return run
