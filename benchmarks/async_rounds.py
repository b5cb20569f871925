"""Buffered (FedBuff) against synchronous rounds for edge devices of different speeds
(docs/benchmarks.md, "Buffered against synchronous rounds").

A real deployment on 127.0.0.1 each time (`fedmvp serve`, TLS, and `edge-client join` devices), the
demo's edge task: every device holds 8 training images of half of the demo's 16 new classes (the
classes the tiny CLIP never saw named) and trains the global LoRA on them. The devices' speeds are
spread 1x .. 10x by throttling their processes (SIGSTOP/SIGCONT duty cycles: a device at 5x runs
1/5 of the time, whatever it is doing), the same devices in both runs.

- synchronous (`mode = "sync"`): every round waits for all devices, the slowest included;
- buffered (`serve --mode buffered`): ``concurrency`` = every device, a version every ``buffer_size``
  updates, each weighted by its staleness (fedmvp/federated/buffered.py), as many device updates in
  all as the synchronous run.

Accuracy: each checkpoint's global LoRA run on the bundle (one ONNX Runtime session, the LoRA fed per
checkpoint) over the held-out test images of the 16 new classes. Time: from the moment every device
is connected to each checkpoint's write. The figure is the time each run takes to first reach the
synchronous run's best accuracy (its last round left out of both searches: it also holds the final
evaluation): ``buffered_vs_sync_time_to_accuracy`` = synchronous time / buffered time (goal >= 2x;
FedBuff reports 3.3x).

    python -m benchmarks async            # 4 devices (1x, 2x, 5x, 10x), 6 rounds against 12 versions
    python -m benchmarks async --quick    # 2 devices (1x, 2x), 2 rounds against 4 versions, 1 epoch each
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Goal, Options, Section, ratio  # noqa: E402
from benchmarks.deploy import FEDMVP, Deployment  # noqa: E402
from benchmarks.sections_cli import section_main, show_ratios  # noqa: E402

SPEEDS = {"full": (1, 2, 5, 10), "quick": (1, 2)}  # slowdown of each device
ROUNDS = {"full": 6, "quick": 2}  # synchronous rounds measured (one more holds the final evaluation)
DUTY_SECONDS = 0.05  # a throttled device runs this long, then sleeps (factor - 1) times it
SHOTS = 8  # training images per class on a device
# local epochs of a device per update (the demo's edge task trains 20); --quick is a smoke test of the
# whole path (both deployments, every checkpoint measured), not a figure: one epoch
EPOCHS = {"full": 5, "quick": 1}
WAIT_SECONDS = 1800


@dataclass
class Mode:
    name: str
    serve_flags: list[str]
    rounds: int  # checkpoints written by the run (the first is the prepared start)


class Throttle:
    """Slows a process group down ``factor`` times: SIGCONT for a slice, SIGSTOP for (factor - 1) slices."""

    def __init__(self, pid: int, factor: int):
        self.pid, self.factor, self.stop = pid, factor, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                os.killpg(self.pid, signal.SIGCONT)
                self.stop.wait(DUTY_SECONDS)
                os.killpg(self.pid, signal.SIGSTOP)
                self.stop.wait(DUTY_SECONDS * (self.factor - 1))
            except ProcessLookupError:
                return
        try:
            os.killpg(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def start(self) -> "Throttle":
        if self.factor > 1:
            self.thread.start()
        return self

    def end(self) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)


def prepare(work: Path, rounds: int, server: str, start_from: Path | None) -> tuple[Path, Path, Path, Path, list[str]]:
    """(the run directory with round 1 written, its bundle, the new classes' local and held-out folders,
    their names): the demo preset with ``server`` (a [server] table) appended, at ``work/devices.toml``."""
    from export.bundle_writer import export_bundle
    from fedmvp.federated.prepare import prepare_run
    from fedmvp.model import FedMVP
    from fedmvp.runs import RunDir
    from fedmvp.presets.schema import preset_path
    from fedmvp_apps.cli.demo import new_class_folders

    preset = work / "devices.toml"
    preset.write_text(preset_path("demo").read_text() + server)
    run = prepare_run(str(preset), str(work / "template"), rounds, resume=False, device="cpu")
    config = run.read_config()
    if start_from is not None:  # a trained run's last round: the demo's edge task exactly
        source = RunDir(start_from)
        state = source.load_checkpoint(source.last_round()).tensors
    else:
        state = FedMVP.from_run(run, 0).state("all")
    run.save_checkpoint(1, state, {"lora_clients": [], "seed": config["seed"], "lr": config["lr"],
                                   "total_rounds": rounds, "method": config["method"], "sites": []})
    local, held_out, classes = new_class_folders(run, SHOTS)
    bundle = export_bundle(run.path, 1, work / "bundle").path
    return run.path, bundle, local, held_out, classes


def device_folders(local: Path, classes: list[str], count: int, work: Path) -> list[Path]:
    """Device i holds half of the classes, shifted by i (overlapping): its own folder of their images."""
    half = max(1, len(classes) // 2)
    folders = []
    for i in range(count):
        folder = work / f"device-{i}" / "local"
        for k in range(half):
            name = classes[(i * len(classes) // count + k) % len(classes)]
            shutil.copytree(local / name, folder / name)
        folders.append(folder)
    return folders


def deploy(mode: Mode, template: Path, bundle: Path, folders: list[Path], speeds: tuple[int, ...],
           work: Path, epochs: int) -> tuple[Path, float]:
    """One deployment of ``mode``: (its run directory, the time every device was connected)."""
    from fedmvp.runs import RunDir
    from fedmvp_apps.deploy.supernode import free_port

    base = work / mode.name
    base.mkdir(parents=True)
    run = base / "run"
    shutil.copytree(template, run)
    copy = RunDir(run)
    copy.write_config({**copy.read_config(), "rounds": mode.rounds})  # atomic, as every write of a run
    subprocess.run([*FEDMVP, "certs", "--out", str(base / "certs")], check=True, capture_output=True)
    superlink = f"127.0.0.1:{free_port()}"
    procs, throttles = Deployment(base), []
    edge = str(Path(sys.executable).parent / "edge-client")
    try:
        procs.start("serve", [*FEDMVP, "serve", "--config", str(work / "devices.toml"), "--run-dir", str(run),
                              "--certs", str(base / "certs"), "--allow-any-node", "--address", superlink,
                              "--min-nodes", str(len(folders)), "--round-timeout", "900", *mode.serve_flags,
                              "--json"])
        deadline = time.time() + WAIT_SECONDS
        while "SuperLink listening" not in procs.log("serve"):
            if procs.procs["serve"].poll() is not None or time.time() > deadline:
                raise RuntimeError(f"serve did not start: {procs.log('serve')[-500:]}")
            time.sleep(0.3)
        for i, folder in enumerate(folders):
            device_bundle = base / f"bundle-{i}"
            shutil.copytree(bundle, device_bundle)
            procs.start(f"device-{i}", [edge, "join", "--superlink", superlink, "--bundle", str(device_bundle),
                                        "--data", str(folder), "--root-certificates", str(base / "certs" / "ca.crt"),
                                        "--epochs", str(epochs), "--lr", "0.01", "--optimizer", "adamw", "--threads", "1"])
        while not all("Connection successful" in procs.log(f"device-{i}") for i in range(len(folders))):
            if procs.procs["serve"].poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the devices did not connect: {procs.log('serve')[-500:]}")
            time.sleep(0.2)
        connected = time.time()
        throttles = [Throttle(procs.procs[f"device-{i}"].pid, factor).start() for i, factor in enumerate(speeds)]
        try:
            code = procs.procs["serve"].wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the {mode.name} run did not finish in {WAIT_SECONDS} s") from None
        if code != 0:
            raise RuntimeError(f"serve exited {code}: {procs.log('serve')[-800:]}")
    finally:
        for throttle in throttles:
            throttle.end()
        procs.stop()
    return run, connected


def accuracies(run: Path, bundle: Path, held_out: Path, rounds: range) -> dict[int, float]:
    """Top-1 on the held-out images of each checkpoint's global LoRA (fed to one session)."""
    import numpy as np
    from safetensors.numpy import load_file

    from edge_client.infer import Predictor
    from edge_client.lora_store import ActiveLora
    from fedmvp.runs import RunDir

    predictor = Predictor(bundle, personalised=False)
    files = sorted(held_out.glob("*/*.png"))
    pixels = np.stack([predictor.decode(path)[0] for path in files])
    labels = np.array([predictor.classes.index(path.parent.name) for path in files])
    out = {}
    for number in rounds:
        path = RunDir(run).round_weights_path(number)
        tensors = {k: v for k, v in load_file(str(path)).items() if k in predictor.bundle.lora_shapes}
        predictor.use_lora(ActiveLora(tensors=tensors, source="global", file=path))
        logits = np.concatenate([predictor.run(pixels[i:i + 64])["logits"] for i in range(0, len(pixels), 64)])
        out[number] = float((logits.argmax(axis=1) == labels).mean())
    return out


def time_to(accuracy: dict[int, float], seconds: dict[int, float], target: float) -> float | None:
    """Seconds to the first checkpoint at or above ``target`` (None: never)."""
    return next((seconds[n] for n in sorted(accuracy) if accuracy[n] >= target - 1e-12), None)


def run(options: Options) -> Section:
    from fedmvp.runs import RunDir

    began = time.perf_counter()
    kind = "quick" if options.quick else "full"
    speeds, sync_rounds = SPEEDS[kind], ROUNDS[kind]
    buffer_size = max(1, len(speeds) // 2)
    versions = sync_rounds * len(speeds) // buffer_size  # as many device updates as the synchronous run
    modes = [Mode("sync", ["--mode", "sync"], 1 + sync_rounds + 1),
             Mode("buffered", ["--mode", "buffered"], 1 + versions + 1)]
    section = Section(name="async", config={"devices": len(speeds), "slowdowns": list(speeds),
                                            "sync_rounds": sync_rounds, "buffered_versions": versions,
                                            "buffer_size": buffer_size, "concurrency": len(speeds),
                                            "local_epochs": EPOCHS[kind], "shots_per_class": SHOTS,
                                            "start": str(options.run) if options.run else "the demo's initial model"})
    with tempfile.TemporaryDirectory(prefix="fedmvp-bench-async-") as tmp:
        work = Path(tmp)
        server = f"\n[server]\nconcurrency = {len(speeds)}\nbuffer_size = {buffer_size}\nmax_staleness = {versions}\n"
        template, bundle, local, held_out, classes = prepare(work, max(m.rounds for m in modes), server, options.run)
        folders = device_folders(local, classes, len(speeds), work)
        results = {}
        for mode in modes:
            run_dir, connected = deploy(mode, template, bundle, folders, speeds, work, EPOCHS[kind])
            measured = range(1, mode.rounds)  # the last one also holds the final evaluation
            acc = accuracies(run_dir, bundle, held_out, measured)
            seconds = {n: max(0.0, RunDir(run_dir).round_state_path(n).stat().st_mtime - connected)
                       for n in measured}
            seconds[1] = 0.0
            results[mode.name] = (acc, seconds)
            for n in measured:
                section.rows.append({"runtime": mode.name, "round": n, "seconds": seconds[n], "accuracy": acc[n]})
    target = max(acc for n, acc in results["sync"][0].items() if n > 1)
    times = {name: time_to(acc, seconds, target) for name, (acc, seconds) in results.items()}
    figure = ratio(times["sync"], times["buffered"]) if times["buffered"] else None
    section.config |= {"target_accuracy": target, "seconds_to_target": times,
                       "start_accuracy": results["sync"][0][1]}
    section.ratios["buffered_vs_sync_time_to_accuracy"] = figure
    section.goals.append(Goal.at_least("buffered vs synchronous, time to the synchronous run's accuracy", figure, 2.0))
    section.notes.append("devices slowed by SIGSTOP/SIGCONT duty cycles of their processes; accuracy of each "
                         "checkpoint's LoRA on the held-out images of the new classes; times from the moment "
                         "every device was connected; both runs' last checkpoint (final evaluation) left out")
    if times["buffered"] is None:
        section.notes.append("the buffered run never reached the synchronous run's best accuracy")
    section.seconds = time.perf_counter() - began
    return section


def show(section: Section) -> None:
    c = section.config
    print(f"{c['devices']} devices slowed {c['slowdowns']}x; {c['sync_rounds']} rounds against "
          f"{c['buffered_versions']} versions (buffer {c['buffer_size']})")
    print(f"{'run':<10} {'round':>5} {'seconds':>8} {'accuracy':>9}")
    for r in section.rows:
        print(f"{r['runtime']:<10} {r['round']:>5} {r['seconds']:8.1f} {100 * r['accuracy']:8.2f}%")
    show_ratios(section)


def main(argv: list[str] | None = None) -> int:
    return section_main(run, show, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
