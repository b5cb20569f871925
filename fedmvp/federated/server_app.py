"""The FedMVP ServerApp: rounds, per-tensor aggregation, a checkpoint every round, evaluation.

Deployed on a SuperLink (``flwr run``), ``app`` reads ``run-dir``, ``preset``, ``rounds`` and
``eval-every`` from the run config and, when ``run-dir`` has no config.json yet, writes it itself
(``prepare_run``, on the ServerApp's machine). In simulation, ``fedmvp train`` prepares the run
directory and builds its own app with ``server_app_for(settings)``. Either way the run
directory's config.json is the record (preset, rounds, method config), and a restart resumes
from the last complete round. The server holds the run's lock (``RUN/.lock``) while it writes rounds
(`run_server`), so `fedmvp ingest` meanwhile is refused or waits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedmvp.federated.flower_log import flower_log
from fedmvp.federated.grid_poll import bounded_reply_pulls
from fedmvp.federated.prepare import check_same_preset, prepare_run
from fedmvp.federated.privacy_budget import run_events
from fedmvp.data.federation_plan import is_open, plan_record
from fedmvp.federated.replies import ClassRules
from fedmvp.federated.site_keys import SiteKeyError, SiteKeys
from fedmvp.federated.site_registry import OpenSites, SiteRegistry, SiteRegistryError
from fedmvp.federated.round_writer import Progress, RoundWriter
from fedmvp.federated.server_modes import server_mode
from fedmvp.federated.strategy_options import RoundPolicy, StrategyOptions
from fedmvp.federated.task import LocalSettings
from fedmvp.federated.wire import array_record, to_numpy_state
from fedmvp.model import FedMVP
from fedmvp.run_lock import lock_existing, run_lock
from fedmvp.run_metrics import truncate_metrics_after
from fedmvp.runs import RunDir, RunError

log = logging.getLogger("fedmvp.server")


@dataclass
class ServerSettings:
    """What the server needs beyond the run directory's config.json. Simulation and deployment differ
    in nothing here but where the settings come from (``fedmvp train``, or the run config) and
    ``client_threads``: the simulation's share of its one machine for each node (None: each node's own)."""

    run_dir: str
    eval_every: int = 0  # 0: evaluate only the last round
    progress: bool = True
    client_threads: int | None = None
    overrides: dict = field(default_factory=dict)  # [server] settings given at run time (fedmvp serve flags)
    bind_keys: bool = False  # a deployment: a [[sites]] node_key binds that site to its key (site_keys.py)

    @classmethod
    def from_run_config(cls, run_config: dict) -> "ServerSettings":
        overrides = {key.replace("-", "_"): run_config[key] for key in RUN_TIME_KEYS if run_config.get(key)}
        return cls(run_dir=str(run_config["run-dir"]), eval_every=int(run_config.get("eval-every", 0)),
                   progress=False, overrides=overrides, bind_keys=True)


# Run-config keys that override the run record's [server] table at run time (0: keep the record's);
# the overrides pass the server rules' one range check (``ServerSpec.with_overrides``).
RUN_TIME_KEYS = ("min-nodes", "round-timeout", "fraction", "mode")
RUN_TIME_WHERE = "fedmvp serve flags (run config min-nodes, round-timeout, fraction, mode)"


EXAMPLE = "flwr run app/ <superlink> --run-config \"preset='demo' run-dir='runs/deployed'\""


def deployment_settings(run_config: dict) -> ServerSettings:
    """``run-dir`` from the run config; a fresh one gets its config.json from ``preset`` (and ``rounds``).

    An existing run directory resumes: ``preset`` may then be empty or must name the same preset,
    ``rounds`` must be 0 or the run's. Bad settings raise RuntimeError before any round starts."""
    run_dir = str(run_config.get("run-dir", "")).strip()
    if not run_dir:
        raise RuntimeError(f"no run directory: set run-dir in the run config ({EXAMPLE})")
    preset = str(run_config.get("preset", "")).strip()
    rounds = int(run_config.get("rounds", 0) or 0)
    if rounds < 0:
        raise RuntimeError(f"rounds must be 0 (the preset's) or positive, got {rounds}")
    run = RunDir(run_dir)
    if not run.exists():
        if not preset:
            raise RuntimeError(f"{run.path}: no config.json yet; set preset in the run config to start a new "
                               f"run (a shipped preset name or a TOML path on the ServerApp's machine: {EXAMPLE})")
        prepare_run(preset, run_dir, rounds or None, resume=False, device="auto", with_data=False)
    else:
        config = run.read_config()
        if preset:
            try:
                check_same_preset(run, config, preset)
            except RunError:
                raise RuntimeError(f"{run.path}: was started with preset {config.get('preset_path')}, not "
                                   f"{preset}; leave preset empty to resume it or use another run-dir") from None
        if rounds and rounds != int(config["rounds"]):
            raise RuntimeError(f"{run.path}: was started with {config['rounds']} rounds; resume keeps them "
                               f"(set rounds=0)")
    return ServerSettings.from_run_config(run_config)


def client_preset(preset_path: str) -> str:
    """What the clients are told to load: a shipped preset by name (its path differs per machine)."""
    from fedmvp.presets.schema import PRESET_DIR

    path = Path(preset_path)
    if path.suffix == ".toml" and path.parent.resolve() == PRESET_DIR.resolve() and path.is_file():
        return path.stem
    return preset_path


SERVER_COMMAND = "fedmvp ServerApp"  # the lock holder's name when the deployed ServerApp takes it


def run_server(grid: Grid, settings: ServerSettings) -> None:
    """All rounds of the run, with the run's lock held (`RunBusy` if another process holds it):
    `fedmvp train` holds it already in this process (simulation); a deployed ServerApp takes it here."""
    with run_lock(settings.run_dir, SERVER_COMMAND, can_wait=False):
        _run_rounds(grid, settings)


def round_policy(run: RunDir, config: dict, settings: ServerSettings) -> RoundPolicy:
    """The run's recorded server rules with this start's overrides (`fedmvp serve` flags), checked by the
    one range check (fedmvp/presets/server.py); ``fraction`` overrides the record's [train] fraction_fit."""
    overrides = dict(settings.overrides)
    fraction = float(overrides.pop("fraction", None) or config.get("fraction", 1.0))
    return RoundPolicy(fraction, run.server(overrides, RUN_TIME_WHERE))


def _class_set_record(run: RunDir) -> dict | None:
    """The run's class set as every train and evaluate message carries it (None: a run without classes.json)."""
    from fedmvp.run_classes import class_set

    classes = run.class_set()
    return None if classes is None else class_set(classes).record()


def open_membership(run: RunDir, preset, run_id: str) -> OpenSites | None:
    """An open federation's sites (a [federation] preset without [[sites]]): the run's name -> id registry
    (RUN/sites.json, checked here, before any round) and its record as sites join; None: sites are listed."""
    if not is_open(preset):
        return None
    try:
        registry = SiteRegistry.load(run.path, run_id)
    except SiteRegistryError as err:
        raise RunError(str(err)) from None
    return OpenSites(registry, lambda names: plan_record(preset, names))


def _run_rounds(grid: Grid, settings: ServerSettings) -> None:
    run = RunDir(settings.run_dir)
    config = run.read_config()
    preset_path, total = run.preset_file(config), int(config["rounds"])
    method, federation = run.method(), run.federation_record()
    start = run.last_round() or 0
    if start >= total:
        log.info("run %s already has %s rounds", run.path, total)
        return
    if start:
        checkpoint = run.load_checkpoint(start)
        initial, lora_clients = to_numpy_state(checkpoint.tensors), checkpoint.state.get("lora_clients", [])
        truncate_metrics_after(run, start)
    else:  # round 0: the initial model, no weights; this machine needs no site's data (the nodes evaluate)
        model = FedMVP.from_run(run, 0, config.get("server_device", "cpu"))
        initial, lora_clients = to_numpy_state(model.state("all")), []
    client_config = {"preset": client_preset(preset_path), "device": config.get("client_device", "cpu"),
                     "method": method.to_dict(), "local": LocalSettings.from_train(config["train"]).to_record(),
                     "threads": settings.client_threads, "class_set": _class_set_record(run)}
    # None: a [federation] site's whole folder, which this server never sees ([server] site_max_examples)
    declared = {c["id"]: None if c["train_images"] is None else int(c["train_images"])
                for c in federation["clients"]}
    preset = run.preset()
    named = preset.federation is not None  # its sites are known by name (docs/architecture.md)
    site_names = {c["id"]: str(c["name"]) for c in federation["clients"]} if named else None
    open_sites = open_membership(run, preset, str(config.get("run_id", run.path.name)))
    try:  # each listed site's key, read before any round (a deployment's nodes prove them; site_keys.py)
        site_keys = SiteKeys.from_preset(preset) if settings.bind_keys and named else None
    except SiteKeyError as err:
        raise RunError(str(err)) from None
    policy = round_policy(run, config, settings)
    options = StrategyOptions(
        client_config=client_config, seed=int(config["seed"]), total_rounds=total, base_lr=float(config["lr"]),
        num_clients=int(config["num_clients"]), run_id=str(config.get("run_id", run.path.name)),
        declared_examples=declared, site_names=site_names, federation=federation,
        class_rules=ClassRules.from_record(federation), policy=policy, round_offset=start,
        lora_clients=lora_clients, open_sites=open_sites, site_keys=site_keys, privacy=run.privacy(),
        privacy_events=run_events(run, start), eval_every=settings.eval_every)
    writer = RoundWriter(run, policy.server, options.privacy, options.privacy_events,
                         progress=Progress(start, total) if settings.progress else None)
    strategy = server_mode(policy.server.mode)(options, writer)

    def zero_shot(server_round: int, arrays) -> None:
        """Flower's central evaluation hook before round 1: a new run's zero-shot row (the nodes evaluate)."""
        if server_round == 0 and start == 0 and run.read_zero_shot() is None:
            run.write_zero_shot(strategy.evaluate_round(grid, None, 0))

    strategy.start(grid, array_record(initial), num_rounds=total - start, evaluate_fn=zero_shot)


def server_app_for(settings: ServerSettings, failures: list | None = None) -> ServerApp:
    """A ServerApp bound to a prepared run directory (``fedmvp train`` on the simulation engine).

    ``failures``: the server's error lands there instead of in Flower's log, so the caller can stop
    with that one line (a non-finite round, a full disk) rather than "stopped after round N"."""
    bound = ServerApp()

    @bound.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            run_server(grid, settings)
        except Exception as err:  # noqa: BLE001 - handed to the caller whole
            if failures is None:
                raise
            failures.append(err)

    return bound


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Deployment: everything comes from the run config (``flwr run ... --run-config``). The run's lock
    is taken before an existing run's config.json is read, and held until the last round is written.
    Flower's warnings and errors, and each left-out reply, are appended to RUN/flower.log."""
    # a device killed mid-reply must not stall the server for hours (grid_poll.py)
    with bounded_reply_pulls(), lock_existing(str(context.run_config.get("run-dir", "")).strip(), SERVER_COMMAND):
        settings = deployment_settings(context.run_config)
        with flower_log(settings.run_dir):  # Flower's warnings, each left-out reply: RUN/flower.log (`serve` says them)
            run_server(grid, settings)

