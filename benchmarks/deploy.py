"""A real deployment's steady round against the same local training in process (docs/benchmarks.md,
"Goals, prompts, communication, Flower, deployment").

Deployment: `fedmvp certs`, `fedmvp serve` (TLS, on 127.0.0.1) and 2 sites by `fedmvp join`, the
demo preset (``benchmarks.flower.preset_file``: with --quick its smallest federation), all real
processes, each site given its share of this machine's cores (`fedmvp join --threads`: sites of a
real deployment have their own machines; two at torch's default, every core each, oversubscribe one). A site's SuperNode runs its messages in one warm process (fedmvp_apps/deploy/
warm_executor.py), so CLIP, the model and the data index are loaded once per site, not per message.
A round's time is read from the run's checkpoints (each written when its round is aggregated):
round 1 holds the sites' start-up and the zero-shot evaluation, the last round the final evaluation;
the rounds between are steady (the median is the figure).

Local training: the same two sites' ``local_train`` (the function the ClientApp calls) for round 2
from the run's round-1 weights, its method, local settings and learning rate, in this process,
after one warm-up call each (the image index and frozen targets built, as in a steady round). The
sites run one after the other here and at the same time in the deployment, on the same CPUs: the
same work, so their sum is what a round's training costs on this machine.

``objects_per_message``: the Flower objects each message and reply of the warm deployment cost the
SuperLink (each a request and a transaction), counted in its own database
(``fedmvp_apps.deploy.object_log``); every message is 3 (docs/architecture.md "Records that travel").

Without --quick the cold path is measured too: the same deployment with Flower's default
``--isolation subprocess`` (a fresh ClientApp process per message: torch, CLIP and the data index
loaded every time), what `fedmvp join` ran before the warm executor.

    python -m benchmarks deploy            # demo preset, 5 rounds, warm and cold
    python -m benchmarks deploy --quick    # 2 clients of 1 shot, 3 rounds (one steady), warm only
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Goal, Options, Section, ratio  # noqa: E402
from benchmarks.flower import preset_file, rounds_for  # noqa: E402
from benchmarks.sections_cli import section_main, show_ratios  # noqa: E402

SITES = (0, 1)
FEDMVP = [sys.executable, "-m", "fedmvp_apps.cli"]
TASK_LINE = re.compile(r"warm ClientApp: task (\d+) of this process \(pid (\d+)\) \S+ (done|failed)")
WAIT_SECONDS = {"quick": 600, "full": 1800}
LOCAL_REPEATS = 5  # timed local_train calls per site (median)


class Deployment:
    """serve + the sites as process groups of their own, logged under ``work``; ``stop`` ends them all."""

    def __init__(self, work: Path):
        self.work = work
        self.env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, command: list[str], env: dict[str, str] | None = None) -> None:
        """A process whose output, and a node's whole Flower log (FEDMVP_FLOWER_LOG: the task lines read
        back here are Flower INFO records, which a join no longer prints), go to ``work/NAME.log``."""
        path = self.work / f"{name}.log"
        env = {**(env or self.env), "FEDMVP_FLOWER_LOG": str(path)}
        with open(path, "ab") as log:
            self.procs[name] = subprocess.Popen(command, cwd=self.work, env=env, stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=True)

    def log(self, name: str) -> str:
        path = self.work / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


ROLES = {"fedmvp_apps.deploy.superlink_process": "SuperLink", "fedmvp_apps.deploy.serverapp_process": "ServerApp",
         "fedmvp_apps.deploy.supernode_process": "SuperNodes", "fedmvp_apps.deploy.warm_executor": "site executors (training)",
         "fedmvp_apps.deploy.superexec_process": "SuperExec", "flwr": "flwr commands", "fedmvp_apps.cli": "serve and join"}


def program(argv: list[str]) -> str:
    """What a command line runs: the module of ``python -m M``, else the script's or executable's name."""
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    first = Path(argv[0]).name if argv else ""
    return Path(argv[1]).name if first.startswith("python") and len(argv) > 1 else first


def cpu_by_process(sessions: set[int]) -> dict[int, tuple[str, float]]:
    """Each live process of ``sessions`` (the deployment's process groups): its role (``ROLES``, by the
    ``program`` it runs) and CPU seconds so far (user + system); empty where there is no /proc."""
    proc, tick = Path("/proc"), os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    found: dict[int, tuple[str, float]] = {}
    for entry in proc.glob("[0-9]*") if proc.is_dir() else ():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue  # ended meanwhile
        if int(fields[3]) in sessions:  # fields[3]: the session id
            role = ROLES.get(program(argv), "other")
            found[int(entry.name)] = (role, (int(fields[11]) + int(fields[12])) / tick)
    return found


def cpu_between(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds spent between two ``cpu_by_process`` snapshots, by role (a process that ended between
    them is not counted)."""
    spent: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        spent[role] = spent.get(role, 0.0) + seconds - before.get(pid, (role, 0.0))[1]
    return spent


def site_threads() -> int:
    """Each site's share of this machine's cores: the sites of a real deployment each have their own
    machine; here they share one, and torch's default (every core, in each) oversubscribes it."""
    return max(1, (os.cpu_count() or 1) // len(SITES))


def site_command(superlink: str, preset: Path, site: int, ca: Path, warm: bool) -> tuple[list[str], dict | None]:
    """`fedmvp join` (warm), or the SuperNode it starts run as Flower's default per-message process (cold)."""
    threads = site_threads()
    if warm:
        return [*FEDMVP, "join", "--superlink", superlink, "--config", str(preset), "--site", str(site),
                "--root-certificates", str(ca), "--threads", str(threads)], None
    from fedmvp_apps.cli.join import site_node_config
    from fedmvp_apps.deploy.supernode import QUIET_ENV, supernode_command
    from fedmvp_formats.messages import THREADS

    args = supernode_command(superlink, f"{site_node_config(str(preset), site)} {THREADS}={threads}", ca)
    args[args.index("--isolation") + 1] = "subprocess"
    return args, {**os.environ, **QUIET_ENV, "FLWR_TELEMETRY_ENABLED": "0"}


def deploy(preset: Path, work: Path, rounds: int, warm: bool, timeout: float) -> dict:
    """One deployment of ``rounds`` rounds; each round's seconds from its checkpoint's time."""
    from fedmvp.runs import RunDir
    from fedmvp_apps.deploy.object_log import objects_per_message, superlink_database, watch
    from fedmvp_apps.deploy.supernode import free_port

    work.mkdir(parents=True)
    subprocess.run([*FEDMVP, "certs", "--out", str(work / "certs")], check=True, capture_output=True)
    superlink = f"127.0.0.1:{free_port()}"
    run = work / "run"
    run_dir = RunDir(run)
    procs = Deployment(work)
    try:
        procs.start("serve", [*FEDMVP, "serve", "--config", str(preset), "--run-dir", str(run), "--certs",
                              str(work / "certs"), "--allow-any-node", "--address", superlink, "--rounds",
                              str(rounds), "--min-nodes", str(len(SITES)), "--json"])
        deadline = time.time() + timeout
        while "SuperLink listening" not in procs.log("serve"):
            if procs.procs["serve"].poll() is not None or time.time() > deadline:
                raise RuntimeError(f"serve did not start: {procs.log('serve')[-500:]}")
            time.sleep(0.3)
        watch(superlink_database(run))  # each message's objects, counted from the SuperLink's database
        began = time.time()
        for site in SITES:
            command, env = site_command(superlink, preset, site, work / "certs" / "ca.crt", warm)
            procs.start(f"site-{site}", command, env)
        sessions = {proc.pid for proc in procs.procs.values()}  # each started in a session of its own
        cpu: dict[int, dict[int, tuple[str, float]]] = {}  # at the checkpoints of round 1 and of the last steady round
        commands: set[int] = set()  # `flwr` commands seen running during the steady rounds (none: serve asks in-process)
        looked = 0.0
        while (code := procs.procs["serve"].poll()) is None:
            if time.time() > deadline:
                raise RuntimeError(f"the deployment did not finish in {timeout:.0f} s")
            for mark in (1, rounds - 1):
                if mark not in cpu and run_dir.round_state_path(mark).exists():
                    cpu[mark] = cpu_by_process(sessions)
            if 1 in cpu and rounds - 1 not in cpu and time.time() - looked > 0.25:
                looked = time.time()
                commands |= {pid for pid, (role, _) in cpu_by_process(sessions).items() if role == "flwr commands"}
            time.sleep(0.05)
        if code != 0:
            raise RuntimeError(f"serve exited {code}: {procs.log('serve')[-500:]}")
    finally:
        procs.stop()
    marks = [began] + [run_dir.round_state_path(r).stat().st_mtime for r in range(1, rounds + 1)]
    tasks = [TASK_LINE.findall(procs.log(f"site-{site}")) for site in SITES]
    steady_cpu = {}
    if len(cpu) == 2 and rounds > 2:  # CPU seconds per steady round, by role
        steady_cpu = {role: seconds / (rounds - 2) for role, seconds in cpu_between(cpu[1], cpu[rounds - 1]).items()}
    return {"run": run, "round_seconds": [b - a for a, b in zip(marks, marks[1:])], "steady_cpu": steady_cpu,
            "objects_per_message": objects_per_message(superlink_database(run)),
            "steady_flwr_commands": len(commands),
            # a task logged twice counts once
            "tasks": [len({(n, pid) for n, pid, _ in t}) for t in tasks], "executor_pids": [len({pid for _, pid, _ in t}) for t in tasks],
            "failed_tasks": sum(status == "failed" for t in tasks for _, _, status in set(t))}


def local_seconds(run_dir: Path, rounds: int) -> dict:
    """Round 2's ``local_train`` of each site, in this process, after one warm-up call each: the median
of LOCAL_REPEATS calls."""
    from fedmvp.federated.strategy import cosine_lr
    from fedmvp.federated.task import LocalSettings, local_train, task_context
    from fedmvp.runs import RunDir

    run = RunDir(run_dir)
    config = run.read_config()
    checkpoint = run.load_checkpoint(1)
    ctx = task_context(run.preset_file(config), run.method(), "cpu")
    settings = LocalSettings.from_train(config["train"])
    lr = cosine_lr(float(config["lr"]), 2, rounds)
    lora = set(checkpoint.state.get("lora_clients", []))
    calls = {site: (lambda s=site: local_train(ctx, ctx.client(s), checkpoint.tensors, 2, lr, s in lora, settings))
             for site in SITES}
    for call in calls.values():
        call()
    times: dict[int, list[float]] = {site: [] for site in calls}
    for _ in range(LOCAL_REPEATS):  # interleaved, the median each: a shared machine's noise spread over both
        for site, call in calls.items():
            start = time.perf_counter()
            call()
            times[site].append(time.perf_counter() - start)
    return {site: statistics.median(values) for site, values in times.items()}


def run(options: Options) -> Section:
    """The warm deployment (and, without --quick, the cold one), then the local training; the ratio."""
    began = time.perf_counter()
    rounds = rounds_for(options.quick)
    timeout = WAIT_SECONDS["quick" if options.quick else "full"]
    with tempfile.TemporaryDirectory(prefix="fedmvp-bench-deploy-") as tmp:
        work = Path(tmp)
        preset = preset_file(work, options.quick)
        results = {"warm": deploy(preset, work / "warm", rounds, True, timeout)}
        local = local_seconds(results["warm"]["run"], rounds)
        if not options.quick:
            results["cold"] = deploy(preset, work / "cold", rounds, False, timeout)
    local_train = sum(local.values())
    steady = slice(1, rounds - 1)
    section = Section(name="deploy", config={
        "preset": "demo" + (" (quick override)" if options.quick else ""), "rounds": rounds, "sites": len(SITES),
        "transport": "TLS on 127.0.0.1", "site_threads": site_threads(), "local_train_seconds": {str(k): v for k, v in local.items()},
        "warm_tasks_per_site": results["warm"]["tasks"], "warm_processes_per_site": results["warm"]["executor_pids"],
        "warm_failed_tasks": results["warm"]["failed_tasks"],
        # where a steady round's CPU goes, every process of the deployment (Linux /proc; empty elsewhere)
        "warm_cpu_seconds_per_steady_round": {role: round(seconds, 3) for role, seconds in
                                              sorted(results["warm"]["steady_cpu"].items())},
        "cpu_cores": os.cpu_count(), "warm_flwr_commands_during_steady_rounds": results["warm"]["steady_flwr_commands"]})
    for kind, result in results.items():
        for number, seconds in enumerate(result["round_seconds"], start=1):
            label = {1: "first (start-up)", rounds: "last (final evaluation)"}.get(number, "steady")
            section.rows.append({"runtime": f"deployment ({kind})", "round": number, "kind": label,
                                 "seconds": seconds})
    section.rows.append({"runtime": "local_train, both sites, in process", "round": 2, "kind": "steady",
                         "seconds": local_train})
    figure = {kind: ratio(statistics.median(result["round_seconds"][steady]), local_train)
              for kind, result in results.items()}
    section.ratios["deploy_round_vs_local_train"] = figure["warm"]
    if "cold" in figure:
        section.ratios["cold_deploy_round_vs_local_train"] = figure["cold"]
    # Flower objects a message and its reply cost the SuperLink (each a request and a transaction): the mean over
    # every message of the warm deployment, read from the SuperLink's database (fedmvp_apps.deploy.object_log)
    section.ratios["objects_per_message"] = results["warm"]["objects_per_message"]
    section.goals.append(Goal.at_most("steady deployment round / the sites' local training", figure["warm"], 1.3))
    section.goals.append(Goal.at_most("Flower objects per message (mean)", section.ratios["objects_per_message"], 3, ""))
    section.notes.append("round seconds from checkpoint times; the steady rounds are those between the first and "
                         "the last (median); local training is both sites' round-2 local_train one after the "
                         "other in this process, after a warm-up call each, the median of "
                         f"{LOCAL_REPEATS} calls each (the deployment runs them at once on the same CPUs, "
                         "each site on its share of the cores). With --quick (one step per site) the figure is mostly fixed costs. "
                         "CPU seconds by role: every process of the deployment between the checkpoints of round 1 and "
                         "of the last steady round, per round (what the sites' training shares the cores with).")
    if options.model:
        section.notes.append(f"--model {options.model} ignored: the demo preset's backbone is used")
    section.seconds = time.perf_counter() - began
    return section


def show(section: Section) -> None:
    """A readable table."""
    c = section.config
    print(f"{c['preset']}: {c['sites']} sites, {c['rounds']} rounds, {c['transport']}; warm executor: "
          f"{c['warm_tasks_per_site']} messages in {c['warm_processes_per_site']} process(es) per site")
    print(f"{'runtime':<40} {'round':>5} {'kind':<24} {'seconds':>8}")
    for r in section.rows:
        print(f"{r['runtime']:<40} {r['round']:>5} {r['kind']:<24} {r['seconds']:8.2f}")
    cpu = c.get("warm_cpu_seconds_per_steady_round") or {}
    if cpu:
        print(f"CPU seconds per steady warm round ({c['cpu_cores']} cores, {sum(cpu.values()):.2f} s in all): "
              + ", ".join(f"{role} {seconds:.2f}" for role, seconds in sorted(cpu.items(), key=lambda kv: -kv[1])))
    show_ratios(section)


def main(argv: list[str] | None = None) -> int:
    return section_main(run, show, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
