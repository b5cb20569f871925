"""The same Flower apps on the Deployment Runtime: a real SuperLink and two SuperNodes on 127.0.0.1.

`flwr run` submits this project's app (the folder `fedmvp_apps.deploy.flower_app` writes) with
``preset`` and ``run-dir`` in the run config; the ServerApp writes the run directory on the
SuperLink's machine. Everything lives under tmp_path: each Flower process gets its own
FLWR_HOME (the CLI's SuperLink connection is a config.toml there), nothing touches ~/.flwr.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from fedmvp.federated.server_app import client_preset, deployment_settings
from fedmvp.run_metrics import read_metrics
from fedmvp.runs import RunDir, RunError, round_dir_name
from fedmvp_apps.deploy.flower_app import write_app_dir
from fedmvp_apps.deploy.supernode import QUIET_ENV, LaunchError, executable, free_port
from tests.deadlines import scaled
from tests.federated.conftest import write_preset


REPO = Path(__file__).resolve().parents[2]
CONNECTION = "fedmvp-test"
ROUNDS = 2
QUIET = {**QUIET_ENV, "PYTHONUNBUFFERED": "1"}


def flower_executable(name: str) -> str | None:
    """The executable of this interpreter's environment, else one on PATH; None: not installed."""
    try:
        return executable(name)
    except LaunchError:
        return None


def tail(path: Path, chars: int = 3000) -> str:
    return f"--- {path.name} ---\n" + (path.read_text(errors="replace")[-chars:] if path.exists() else "(none)")


class Deployment:
    """A SuperLink and SuperNodes as subprocesses; ``stop`` ends every one of them."""

    def __init__(self, root: Path, num_nodes: int):
        self.root, self.num_nodes = root, num_nodes
        self.exe = {name: flower_executable(name) for name in ("flower-superlink", "flower-supernode", "flwr")}
        self.procs: list[tuple[subprocess.Popen, Path]] = []
        self.link_port = free_port()
        self.cli_home = root / "cli-home"
        self.cli_home.mkdir(parents=True)
        (self.cli_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n'
            f'[superlink.{CONNECTION}]\naddress = "127.0.0.1:{self.link_port}"\ninsecure = true\n')

    def env(self, home: Path) -> dict[str, str]:
        home.mkdir(parents=True, exist_ok=True)
        return {**os.environ, **QUIET, "FLWR_HOME": str(home)}

    def spawn(self, name: str, args: list[str], log_name: str) -> None:
        log_path = self.root / f"{log_name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([self.exe[name], *args], cwd=self.root,
                                    env=self.env(self.root / f"{log_name}-home"), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((proc, log_path))

    def logs(self) -> str:
        return "\n".join(tail(path) for _, path in self.procs)

    def start(self) -> None:
        self.spawn("flower-superlink", ["--insecure", "--port", str(self.link_port),
                                        "--disable-runtime-dependency-installation"], "superlink")
        for i in range(self.num_nodes):
            self.spawn("flower-supernode", ["--insecure", "--superlink", f"127.0.0.1:{self.link_port}",
                                            "--port", str(free_port()),
                                            "--node-config", f"partition-id={i} num-partitions={self.num_nodes}"],
                       f"supernode-{i}")
        deadline = time.time() + scaled(90)
        nodes = [path for _, path in self.procs[1:]]
        while not all("SuperNode ID:" in p.read_text(errors="replace") for p in nodes):
            dead = [path.name for proc, path in self.procs if proc.poll() is not None]
            assert not dead, f"{dead} exited at start\n{self.logs()}"
            assert time.time() < deadline, f"SuperNodes never connected\n{self.logs()}"
            time.sleep(0.3)

    def stop(self) -> None:
        for proc, _ in self.procs:  # each process group: the SuperExec and app processes too
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, _ in self.procs:
            try:
                proc.wait(timeout=scaled(10))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # stragglers in the group, if any
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()

    def flwr(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([self.exe["flwr"], *args], cwd=REPO, env=self.env(self.cli_home),
                              capture_output=True, text=True, timeout=scaled(timeout))

    def run_app(self, run_config: str, last_state: Path, timeout: float = 180) -> dict:
        """`flwr run` of the federation's app folder; wait for ``last_state`` (the last round's state.json,
        a file: no interpreter per poll), then ask `flwr ls` for the run's status, backing off from 0.5 s
        (each `flwr ls` is an interpreter start; polling it every second cost a core for the whole run)."""
        app = write_app_dir(self.root / "app")
        started = self.flwr("run", str(app), CONNECTION, "--run-config", run_config, "--format", "json")
        assert started.returncode == 0, started.stdout + started.stderr + self.logs()
        run_id = json.loads(started.stdout)["run-id"]
        deadline, pause = time.time() + scaled(timeout), 0.5
        while not last_state.exists():
            dead = [path.name for proc, path in self.procs if proc.poll() is not None]
            assert not dead, f"{dead} exited during run {run_id}\n{self.logs()}"
            assert time.time() < deadline, f"run {run_id}: no {last_state} within {scaled(timeout):g} s\n{self.logs()}"
            time.sleep(0.3)
        while True:
            listed = self.flwr("ls", CONNECTION, "--run-id", str(run_id), "--format", "json")
            assert listed.returncode == 0, listed.stdout + listed.stderr
            run = json.loads(listed.stdout)["runs"][0]
            if run["status"].startswith("finished"):
                return run
            assert time.time() < deadline, f"run {run_id} still {run['status']}\n{self.logs()}"
            time.sleep(pause)
            pause = min(pause * 2, 4.0)


@pytest.fixture
def deployment(tmp_path):
    deploy = Deployment(tmp_path / "deploy", num_nodes=2)
    missing = [name for name, exe in deploy.exe.items() if exe is None]
    if missing:
        pytest.skip(f"Flower executables not installed: {', '.join(missing)}")
    try:
        deploy.start()
        yield deploy
    finally:
        deploy.stop()


def deployment_preset(folder: Path, world: Path) -> Path:
    """The federated tests' preset (4 base + 2 new classes, 2 clients, batch 4), 2 rounds, shipped
    weights (the apps must import the installed fedmvp, not a FAB copy without its weights)."""
    path = write_preset(folder, world)
    text = path.read_text().replace("rounds = 3", f"rounds = {ROUNDS}")
    path.write_text(text.replace('pretrained = ""', 'pretrained = "synthetic"'))
    return path


@pytest.mark.slow  # Flower's own SuperLink and SuperNodes, two `flwr run`s of two rounds each
@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
@pytest.mark.timeout(240)
def test_superlink_and_supernodes_train_and_checkpoint(deployment, small_world, tmp_path):
    preset = deployment_preset(tmp_path, small_world)
    # Relative, as in the README: the run directory is on the SuperLink's machine, relative to its
    # working directory.
    last_state = deployment.root / "runs" / "deployed" / round_dir_name(ROUNDS) / "state.json"
    run = deployment.run_app(f"preset='{preset}' run-dir='runs/deployed'", last_state)
    assert run["status"] == "finished:completed", f"{run}\n{deployment.logs()}"
    run_dir = RunDir(deployment.root / "runs" / "deployed")

    config = run_dir.read_config()
    assert config["preset_path"] == str(preset) and config["rounds"] == ROUNDS and config["num_clients"] == 2
    assert run_dir.rounds() == list(range(1, ROUNDS + 1))
    for number in run_dir.rounds():
        tensors = load_file(str(run_dir.round_path(number) / "global.safetensors"))
        assert any(k.startswith("promptformer.") for k in tensors) and any(k.startswith("lora.") for k in tensors)
    state = json.loads((run_dir.round_path(ROUNDS) / "state.json").read_text())
    assert state["complete"] and state["lora_clients"] == [0, 1]  # both partitions trained and reported

    rows = read_metrics(run_dir)
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))
    assert all(r["clients"] == 2 and math.isfinite(r["train_loss"]) and r["train_loss"] > 0 for r in rows)
    assert all(0.0 <= rows[-1][k] <= 1.0 for k in ("local", "base", "new", "hm"))
    assert set(run_dir.read_zero_shot()) >= {"local", "base", "new", "hm"}
    assert (run_dir.path / "metrics.csv").read_text().startswith("round,train_loss")

    # The same command again resumes the run directory: it is complete, so nothing is redone.
    before = (run_dir.round_path(ROUNDS) / "global.safetensors").read_bytes()
    again = deployment.run_app(f"preset='{preset}' run-dir='runs/deployed'", last_state)
    assert again["status"] == "finished:completed", f"{again}\n{deployment.logs()}"
    assert run_dir.rounds() == list(range(1, ROUNDS + 1))
    assert (run_dir.round_path(ROUNDS) / "global.safetensors").read_bytes() == before


# ---- the ServerApp's run config, without Flower processes ---------------------------------------
def test_run_config_prepares_a_fresh_run_directory_and_resumes_an_existing_one(preset_file, tmp_path):
    run_dir = tmp_path / "fresh"
    settings = deployment_settings({"run-dir": str(run_dir), "preset": str(preset_file), "rounds": 2,
                                    "eval-every": 1})
    assert settings.run_dir == str(run_dir) and settings.eval_every == 1 and not settings.progress
    config = RunDir(run_dir).read_config()
    assert config["rounds"] == 2 and config["preset_path"] == str(preset_file)
    written = (run_dir / "config.json").read_bytes()
    for resume in ({"run-dir": str(run_dir)}, {"run-dir": str(run_dir), "preset": str(preset_file), "rounds": 2}):
        deployment_settings(resume)
    assert (run_dir / "config.json").read_bytes() == written


@pytest.mark.parametrize("run_config,message", [
    ({}, "no run directory: set run-dir"),
    ({"run-dir": "RUN"}, "no config.json yet; set preset"),
    ({"run-dir": "DONE", "rounds": 5}, "was started with 2 rounds"),
    ({"run-dir": "DONE", "preset": "demo"}, "was started with preset"),
])
def test_bad_run_config_is_one_clear_error(preset_file, tmp_path, run_config, message):
    deployment_settings({"run-dir": str(tmp_path / "done"), "preset": str(preset_file), "rounds": 2})
    paths = {"RUN": str(tmp_path / "new"), "DONE": str(tmp_path / "done")}
    run_config = {k: paths.get(v, v) for k, v in run_config.items()}
    with pytest.raises(RuntimeError, match=message):
        deployment_settings(run_config)
    assert not (tmp_path / "new").exists()


def test_clients_get_a_shipped_preset_by_name_and_any_other_by_path(preset_file):
    from fedmvp.presets.schema import preset_path

    assert client_preset(str(preset_path("demo").resolve())) == "demo"
    assert client_preset(str(preset_file)) == str(preset_file)


def test_server_settings_reach_the_round_policy(preset_file, tmp_path):
    """A preset's [server] table is recorded with the run and shapes the rounds; `fedmvp serve` flags
    (run-config keys) override it at run time."""
    from fedmvp.federated.server_app import ServerSettings, round_policy
    from fedmvp.presets.server import ServerSpec

    text = preset_file.read_text() + ("\n[server]\nmin_nodes = 2\nround_timeout = 45.0\nnode_wait = 5.0\n"
                                      "max_update_norm = 3.5\nupdate_norm_action = \"clip\"\n")
    preset_file.write_text(text)
    deployment_settings({"run-dir": str(tmp_path / "r"), "preset": str(preset_file)})
    run = RunDir(tmp_path / "r")
    recorded = ServerSpec(min_nodes=2, round_timeout=45.0, node_wait=5.0, max_update_norm=3.5,
                          update_norm_action="clip")
    assert run.read_config()["server"] == recorded.record()
    policy = round_policy(run, run.read_config(), ServerSettings(run_dir=str(run.path)))
    assert policy.server == recorded and policy.fraction == 1.0
    settings = ServerSettings.from_run_config({"run-dir": "r", "min-nodes": 1, "round-timeout": 9.0, "fraction": 0})
    assert settings.overrides == {"min_nodes": 1, "round_timeout": 9.0} and settings.client_threads is None
    merged = round_policy(run, run.read_config(), settings)
    assert merged.server == dataclasses.replace(recorded, min_nodes=1, round_timeout=9.0) and merged.fraction == 1.0
    bad = ServerSettings.from_run_config({"run-dir": "r", "round-timeout": -1.0})
    with pytest.raises(RunError, match="round_timeout must be a finite number of seconds > 0, got -1.0"):
        round_policy(run, run.read_config(), bad)
