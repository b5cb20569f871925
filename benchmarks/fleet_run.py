"""One fleet deployment for the fleet benchmark (``benchmarks.fleet``): `fedmvp serve --mode buffered`
(TLS, node keys), N devices, a measured window; what the server side cost.

Devices are replay devices (``benchmarks.fleet_device``: a real SuperNode each, the ClientApp replayed)
or real `edge-client join` devices (``benchmarks.async_rounds``: a bundle and images each). CPU seconds
and resident memory come from /proc (``benchmarks.deploy.cpu_by_process``, by role), the versions'
contents and times from their state.json and checkpoint times, each update's reply time from the
replay devices' event lines.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmarks.common import REPO
from benchmarks.deploy import FEDMVP, Deployment, cpu_between, cpu_by_process

DEVICES_PER_EXECUTOR = 25  # replay devices served by one process (threads); more processes use more cores
SERVER_ROLES = ("SuperLink", "ServerApp", "SuperExec", "serve and join")


@dataclass
class FleetPlan:
    """What one deployment runs: ``devices`` of ``kind`` for ``window`` seconds once all are working."""

    devices: int
    window: float
    kind: str = "replay"  # or "real" (edge-client join)
    vanish: int = 0  # after the stages, one more window in which this many devices die mid-update
    vanish_window: float = 0.0
    stages: tuple[int, ...] = ()  # fleet sizes measured in turn in one deployment (empty: ``devices``)
    train_seconds: tuple[float, float] = (2.0, 6.0)
    start_timeout: float = 420.0


@dataclass
class FleetResult:
    """The measured window of one deployment."""

    plan: FleetPlan
    seconds: float
    cpu: dict[str, float]  # CPU seconds in the window by role
    rss_mb: dict[str, float]  # peak resident MB in the window by role (all its processes summed)
    accepted: int  # updates in the versions written in the window
    versions: int
    latency: list[float]  # seconds from a used update's reply to the checkpoint of the version that used it
    version_seconds: list[float]  # each version's gathering time (state.json ``seconds``)
    timed_out: int
    rejected: list[str]
    vanished: int
    messages: dict[str, int] = field(default_factory=dict)
    objects: dict[str, float] = field(default_factory=dict)
    sqlite_objects: int | None = None


def rss_by_role(sessions: set[int]) -> dict[str, float]:
    """Resident MB of the live processes of ``sessions`` by role (/proc/PID/statm, as ``cpu_by_process``
    finds them)."""
    page = os.sysconf("SC_PAGE_SIZE") / (1 << 20)
    out: dict[str, float] = {}
    for pid, (role, _) in cpu_by_process(sessions).items():
        try:
            pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out[role] = out.get(role, 0.0) + pages * page
    return out


def wait_for(check, timeout: float, what: str, procs: Deployment) -> None:
    deadline = time.time() + timeout
    while not check():
        if procs.procs["serve"].poll() is not None:
            raise RuntimeError(f"serve exited while waiting for {what}: {procs.log('serve')[-600:]}")
        dead = next((name for name, p in procs.procs.items() if p.poll() not in (None, 0)), None)
        if dead is not None:
            raise RuntimeError(f"{dead} exited while waiting for {what}: {procs.log(dead)[-600:]}")
        if time.time() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:.0f} s; serve: {procs.log('serve')[-400:]}")
        time.sleep(0.3)


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def start_replay(procs: Deployment, plan: FleetPlan, first: int, superlink: str, certs: Path, work: Path,
                 events: Path) -> None:
    """SuperNodes ``first`` .. ``plan.devices - 1`` (role edge, node key i) and the replay processes that
    answer their messages."""
    from fedmvp_apps.deploy.supernode import QUIET_ENV, supernode_command

    secret = work / "superexec.secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    env = {**procs.env, **QUIET_ENV}
    specs = []
    for i in range(first, plan.devices):
        args = supernode_command(superlink, "role='edge'", certs / "ca.crt", certs / f"node-{i}")
        procs.start(f"node-{i}", [*args, "--superexec-auth-secret-file", str(secret)], env)
        specs.append({"runtime": f"127.0.0.1:{args[args.index('--port') + 1]}", "secret_file": str(secret),
                      "supernode_pid": procs.procs[f"node-{i}"].pid, "bundle_id": f"replay-{i:05d}",
                      "train_seconds": list(plan.train_seconds),
                      "vanish_file": str(work / "vanish") if i < plan.vanish else ""})
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for k in range(0, len(specs), DEVICES_PER_EXECUTOR):
        spec = work / f"replay-{first + k}.json"
        spec.write_text(json.dumps(specs[k:k + DEVICES_PER_EXECUTOR]))
        procs.start(f"replay-{first + k}", [sys.executable, "-m", "benchmarks.fleet_device", "--spec", str(spec),
                                    "--events", str(events)], env)


def start_real(procs: Deployment, plan: FleetPlan, superlink: str, certs: Path, work: Path,
               real: "RealDevices") -> None:
    """`edge-client join` devices, each a bundle copy and its images (``benchmarks.async_rounds``)."""
    edge = str(Path(sys.executable).parent / "edge-client")
    for i in range(plan.devices):
        bundle = work / f"bundle-{i}"
        shutil.copytree(real.bundle, bundle)
        procs.start(f"node-{i}", [edge, "join", "--superlink", superlink, "--bundle", str(bundle), "--data",
                                  str(real.folders[i]), "--root-certificates", str(certs / "ca.crt"),
                                  "--auth-key", str(certs / f"node-{i}"), "--epochs", "1", "--threads", "1"])


@dataclass
class RealDevices:
    """A prepared run (round 1 written) and its bundle, with each real device's image folder."""

    template: Path
    bundle: Path
    folders: list[Path]


def deploy_fleet(plan: FleetPlan, preset: Path, certs: Path, work: Path, real: RealDevices | None = None
                 ) -> list[FleetResult]:
    """Serve, then the devices in stages (``plan.stages``: the fleet's size at each; one stage of
    ``plan.devices`` by default), each measured over ``plan.window`` seconds once every device got work.
    One deployment for every stage: the server's start and its zero-shot evaluation happen once."""
    from fedmvp.runs import RunDir
    from fedmvp_apps.deploy.supernode import free_port

    work.mkdir(parents=True)
    run = work / "run"
    if real is not None:
        shutil.copytree(real.template, run)
    superlink = f"127.0.0.1:{free_port()}"
    procs = Deployment(work)
    events = work / "events.jsonl"
    measured: list[tuple[FleetPlan, float, float, dict, dict, float]] = []
    try:
        procs.start("serve", [*FEDMVP, "serve", "--config", str(preset), "--run-dir", str(run), "--certs", str(certs),
                              "--node-keys", str(node_keys(certs, plan.devices, work)), "--address", superlink, "--mode", "buffered",
                              "--min-nodes", "1", "--rounds", "100000", "--json"])
        # the node keys are admitted once the SuperLink listens; a SuperNode before that is refused
        wait_for(lambda: "submitted" in procs.log("serve"), plan.start_timeout, "the run's start", procs)
        server = {procs.procs["serve"].pid}
        started, sizes = 0, list(plan.stages or (plan.devices,))
        while sizes:
            size = sizes.pop(0)
            stage = replace(plan, devices=size, vanish=0)
            began = time.time()
            if real is None:
                start_replay(procs, replace(stage, vanish=plan.vanish), started, superlink, certs, work, events)
                working = lambda n=size: len({e["node"] for e in read_events(events) if e["kind"] == "train"}) >= n
            else:
                start_real(procs, stage, superlink, certs, work, real)
                working = lambda n=size: all("training the global LoRA" in procs.log(f"node-{i}") for i in range(n))
            wait_for(working, plan.start_timeout, f"all {size} devices working", procs)
            started = size
            measured.append((stage, *window(procs, server, plan.window), time.time() - began))
        if plan.vanish:  # the first ``vanish`` devices die at their next train message (fleet_device)
            (work / "vanish").touch()
            measured.append((plan, *window(procs, server, plan.vanish_window), plan.vanish_window))
        sqlite_objects = count_sqlite_objects(run.parent / f".{run.name}.flwr" / "superlink.db")
    finally:
        procs.stop()
    results = []
    all_events = read_events(events)
    for stage, t0, t1, cpu, rss, took in measured:
        result = summarise(stage, RunDir(run), all_events, t0, t1, cpu, rss)
        result.sqlite_objects = sqlite_objects
        result.messages["start_seconds"] = round(took - (t1 - t0), 1)
        results.append(result)
    return results


def window(procs: Deployment, server: set[int], seconds: float) -> tuple[float, float, dict, dict]:
    """(start, end, CPU-s by role, peak resident MB by role) over ``seconds``: the server's session by
    role, every device process together (``devices``)."""
    devices = {p.pid for name, p in procs.procs.items() if name != "serve"}
    before = {"server": cpu_by_process(server), "devices": cpu_by_process(devices)}
    t0, rss = time.time(), {}
    while time.time() - t0 < seconds:
        for role, mb in {**rss_by_role(server), "devices": sum(rss_by_role(devices).values())}.items():
            rss[role] = max(rss.get(role, 0.0), mb)
        time.sleep(min(2.0, max(0.1, seconds - (time.time() - t0))))
    after = {"server": cpu_by_process(server), "devices": cpu_by_process(devices)}
    t1 = time.time()
    spent = {**cpu_between(before["server"], after["server"]),
             "devices": sum(cpu_between(before["devices"], after["devices"]).values())}
    return t0, t1, spent, rss


def node_keys(certs: Path, devices: int, work: Path) -> Path:
    """The first ``devices`` lines of ``certs/node-keys.txt`` (keys node-0 ..): serve registers each key
    it is given with one `flwr supernode register` call at its start, so it is given only those used."""
    lines = (certs / "node-keys.txt").read_text().splitlines()[:devices]
    path = work / "node-keys.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def count_sqlite_objects(db: Path) -> int | None:
    """Rows of the SuperLink's object store (flwr 1.42 ``SqlObjectStore``) now: objects not yet delivered
    and released (Flower deletes an object once its message is delivered)."""
    if not db.exists():
        return None
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
            name = next((t for t in tables if "object" in t.lower() and "children" not in t.lower()
                         and "run" not in t.lower()), None)
            return None if name is None else int(conn.execute(f'SELECT COUNT(*) FROM "{name}"').fetchone()[0])
    except sqlite3.Error:
        return None


def summarise(plan: FleetPlan, run, events: list[dict], t0: float, t1: float, cpu: dict[str, float],
              rss: dict[str, float]) -> FleetResult:
    """The versions written in [t0, t1]: their updates, each update's reply-to-version time, timeouts."""
    replied: dict[tuple[int, int], list[float]] = {}  # a device may be sent the same version twice
    for e in events:
        if e["kind"] == "train" and "replied" in e:
            replied.setdefault((e["node"], e["round"]), []).append(e["replied"])
    accepted = versions = timed_out = 0
    latency, gathered, rejected = [], [], []
    number = 1
    while run.round_state_path(number).exists() or run.round_state_path(number + 1).exists():
        path = run.round_state_path(number)
        number += 1
        if not path.exists():
            continue
        written = path.stat().st_mtime
        if not t0 <= written <= t1:
            continue
        state = json.loads(path.read_text())
        replies = state.get("replies") or []
        if not replies:
            continue
        versions += 1
        accepted += len(replies)
        gathered.append(float(state.get("seconds") or 0.0))
        timed_out += len(state.get("timed_out") or [])
        rejected += [str(r.get("reason")) for r in state.get("rejected") or []]
        for r in replies:
            sent = [t for t in replied.get((r.get("node"), int(r.get("base", -2)) + 1), []) if t <= written]
            if sent:  # the latest reply of that device for that version before the version was written
                latency.append(written - max(sent))
    kinds = {}
    for e in events:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    objects = {}
    for e in events:
        if "objects_out" in e and e["kind"] == "train":
            objects.setdefault("train_in", []).append(e["objects_in"])
            objects.setdefault("train_reply", []).append(e["objects_out"])
    return FleetResult(plan=plan, seconds=t1 - t0, cpu=cpu, rss_mb=rss, accepted=accepted, versions=versions,
                       latency=latency, version_seconds=gathered, timed_out=timed_out, rejected=rejected,
                       vanished=sum(1 for e in events if t0 <= e.get("vanished", 0) <= t1), messages=kinds,
                       objects={k: statistics.median(v) for k, v in objects.items()})


def make_certs(out: Path, nodes: int) -> Path:
    """`fedmvp certs` with ``nodes`` node key pairs (node-N, node-keys.txt): one set for every run."""
    subprocess.run([*FEDMVP, "certs", "--out", str(out), "--nodes", str(nodes)], check=True, capture_output=True)
    return out
