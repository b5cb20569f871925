"""Training step cost: the edge LoRA step with and without activation checkpointing, and the
server-side full PromptFormer step, time per step and peak activation memory.

Edge: ``edge_client.train.train_local`` on an exported bundle (``train.pt2`` run by
``edge_client.program.GraphRunner``), with ``checkpoint_segments=1`` (no checkpointing, the CPU
default) and ``checkpoint_segments=0`` (auto: about one transformer block per checkpointed piece,
the CUDA default; ``edge_client.train._segments``). Full PromptFormer: the Flower client's round,
``fedmvp.federated.task.local_train`` with ``lora_active=False`` (every PromptFormer tensor trains).
Both on the same backbone (random init; the bundle is exported with ``export.bundle_writer``,
fp32, trainable) at the same batch sizes.

Each configuration runs in a fresh subprocess, so one's memory never shows in another's. Per
configuration: 1 warm-up step, then ``repeats`` timed steps (default 2: a ViT-B-16 step at batch 32
takes about a minute on 2 CPU cores; 1 with --quick). Edge step times come from the
``on_step`` callback (time between steps, the callback's own work excluded); the PromptFormer step
time is one ``local_train`` call of ``repeats`` steps divided by ``repeats`` (its per-round work,
loading the state and cloning the result, is included and small).

Peak activation memory: on CUDA ``torch.cuda.max_memory_allocated`` during the measured step(s)
minus what was allocated before them. On CPU the kernel's peak-RSS mark (``VmHWM``) is reset
(``/proc/self/clear_refs``) after the warm-up, so peak RSS during the measured step minus RSS
before it is the step's own memory; glibc is told to give large blocks back at once
(``MALLOC_MMAP_THRESHOLD_``), else freed activations would stay in the baseline.

    python -m benchmarks.train                 # ViT-B-16, batch 8 and 32 (minutes)
    python -m benchmarks.train --quick --json  # fedmvp-tiny, batch 2 and 4, 1 timed step
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, Goal, Options, Section, current_rss_mb, ratio  # noqa: E402
from benchmarks.sections_cli import section_main, show_ratios  # noqa: E402

FULL = {"model": "ViT-B-16", "batches": (8, 32), "repeats": 2}
QUICK = {"model": "fedmvp-tiny", "batches": (2, 4), "repeats": 1}
CLASSES = 4
CHECKPOINTING = {"off": 1, "auto": 0}  # label -> TrainOptions.checkpoint_segments
MMAP_THRESHOLD = 128 * 1024  # fixed: blocks above it are mmapped and unmapped on free


# ---- setup (parent process) ------------------------------------------------------------------------------
def class_names() -> list[str]:
    from benchmarks.edge_models import class_set

    return class_set(CLASSES, 2).names


def run_worker(job: dict, threads: int | None) -> dict:
    """Run one configuration in a fresh interpreter; its last stdout line is the JSON result."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(MMAP_THRESHOLD),
           "FEDMVP_TEXT_CACHE": job["text_cache"]}  # never the user's cache
    if threads:
        job = {**job, "threads": threads}
    done = subprocess.run([sys.executable, "-m", "benchmarks.train", "--worker", json.dumps(job)], cwd=REPO,
                          env=env, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = " ".join(done.stderr.split())[-400:]
        return {"error": f"worker exited {done.returncode}: {tail}"}
    return json.loads(lines[-1])


# ---- memory probes (worker process) ----------------------------------------------------------------------
class MemoryProbe:
    """Peak memory of a stretch of work above what was in use before it (CPU RSS or CUDA allocations)."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"
        self.base_mb = 0.0

    def start(self) -> None:
        """Forget the peak so far; what is in use now is the baseline."""
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base_mb = torch.cuda.memory_allocated() / 2**20
        else:
            reset_peak_rss()
            self.base_mb = current_rss_mb()

    def stop(self) -> dict:
        """Peak (MB) since `start`, and peak minus the baseline (the work's own memory)."""
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**20
            return {"peak_gpu_mb": peak, "activation_mb": peak - self.base_mb, "baseline_mb": self.base_mb}
        peak = status_mb("VmHWM")
        return {"peak_rss_mb": peak, "activation_mb": peak - self.base_mb, "baseline_mb": self.base_mb}


def reset_peak_rss() -> None:
    """Set this process's peak-RSS mark (VmHWM) to its RSS now (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def status_mb(key: str) -> float:
    """A ``/proc/self/status`` memory line (kB) in MB."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


# ---- the two steps (worker process) ----------------------------------------------------------------------
def edge_job(job: dict) -> dict:
    """Time and memory of the edge LoRA step through `train_local` (warm-up step 1, then timed steps)."""
    import torch

    from edge_client.train import train_local

    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    probe, marks, steps = MemoryProbe(job["device"]), [], []  # steps: seconds of steps 2.. (1 warms up)
    memory: dict = {}

    def on_step(step: int, _loss: float) -> None:
        if job["device"] == "cuda":
            torch.cuda.synchronize()
        ended = time.perf_counter()
        if marks:
            steps.append(ended - marks[-1])
        if step == 1:
            probe.start()
        elif step == 2:
            memory.update(probe.stop())
        marks.append(time.perf_counter())  # after the probe's own work: it is not timed

    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedmvp-bench-train-") as out:
        result = train_local(job["data"], job["bundle"], epochs=1, batch_size=job["batch"], out=out, apply=False,
                             device=job["device"], checkpoint_segments=job["segments"], optimizer="sgd",
                             on_step=on_step)
    return {"seconds_per_step": sorted(steps)[len(steps) // 2], "steps_timed": len(steps),
            "segments_used": result.checkpoint_segments, "total_seconds": time.perf_counter() - began, **memory}


def promptformer_job(job: dict) -> dict:
    """Time and memory of the Flower client's local step training the whole PromptFormer."""
    import torch

    from fedmvp.attributes.sentences import SentenceStyle
    from fedmvp.clip import load_clip
    from fedmvp.data.federation import ClientData
    from fedmvp.federated.task import LocalSettings, TaskContext, local_train
    from fedmvp.model import FedMVP
    from fedmvp.presets.schema import load_preset

    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    device = torch.device(job["device"])
    torch.manual_seed(0)
    clip = load_clip(job["model"], None, device=device)
    model = FedMVP(clip).to(device)
    ctx = TaskContext(preset=load_preset("demo", check_roots=False), federation=None, clip=clip, model=model,
                      device=device)
    files = sorted(Path(job["data"]).glob("*/*.png"))
    names = class_names()
    samples = [(str(p), names.index(p.parent.name)) for p in files]
    attributes = {n: [f"a round outline {i}", f"a bright colour {i}"] for i, n in enumerate(names)}

    def client(client_id: int, count: int) -> ClientData:
        return ClientData(client_id=client_id, name="bench", dataset="bench", domain=None, class_names=names,
                          train=samples[:count], test=[], attributes=attributes, style=SentenceStyle())

    batch, repeats = job["batch"], job["repeats"]
    settings = LocalSettings(local_epochs=1, batch_size=batch, momentum=0.9, weight_decay=1e-5, sigma=0.5)
    state = model.state("all")
    warm, timed = client(1, batch), client(0, batch * repeats)
    local_train(ctx, warm, state, 1, 0.003, False, settings)  # warm-up: one step
    images, _labels = ctx.images("train/0", timed.train)  # decode and frozen targets before the baseline,
    ctx.frozen_targets("train/0", images)                  # as the cached worker context has them by round 2
    probe = MemoryProbe(job["device"])
    probe.start()
    start = time.perf_counter()
    local_train(ctx, timed, state, 2, 0.003, False, settings)
    if job["device"] == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"seconds_per_step": seconds / repeats, "steps_timed": repeats, **probe.stop()}


def worker(spec: str) -> int:
    """``--worker JSON``: run one configuration, print its result as the last line."""
    import logging
    import warnings

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    job = json.loads(spec)
    result = edge_job(job) if job["kind"] == "edge" else promptformer_job(job)
    print(json.dumps(result))
    return 0


# ---- the section -----------------------------------------------------------------------------------------
def plan(options: Options) -> tuple[str, tuple[int, ...], int]:
    """Model, batch sizes and timed steps for these options."""
    preset = QUICK if options.quick else FULL
    return options.model or preset["model"], preset["batches"], options.repeats or preset["repeats"]


def run_in_process(job: dict, threads: int | None) -> dict:
    """One configuration in this process (tests: no interpreter start, the program loaded once).
    glibc keeps its dynamic mmap threshold here (setting it would slow the host process for good),
    so a freed activation of an earlier configuration may be reused below another's baseline."""
    import torch

    previous = torch.get_num_threads()
    try:
        return edge_job({**job, "threads": threads}) if job["kind"] == "edge" else \
            promptformer_job({**job, "threads": threads})
    finally:
        torch.set_num_threads(previous)


def run(options: Options, *, fresh_processes: bool = True) -> Section:
    """Edge step (checkpointing off / auto) and full PromptFormer step, per batch size.

    ``fresh_processes=False`` runs every configuration in this process: faster (tests), but memory
    figures then share one process's allocator."""
    began = time.perf_counter()
    from benchmarks.edge_models import random_bundle, write_image_folder

    measure = run_worker if fresh_processes else run_in_process
    model, batches, repeats = plan(options)
    section = Section(name="train", config={"model": model, "batches": list(batches), "timed_steps": repeats,
                                            "warmup_steps": 1, "device": options.device,
                                            "threads": options.threads, "edge_precision": "fp32",
                                            "classes": CLASSES, "fresh_processes": fresh_processes})
    with tempfile.TemporaryDirectory(prefix="fedmvp-bench-train-") as tmp:
        work = Path(tmp)
        export_start = time.perf_counter()
        bundle = random_bundle(work, model, CLASSES, 2)
        section.config["export_seconds"] = round(time.perf_counter() - export_start, 2)
        for batch in batches:
            data = write_image_folder(work / f"data-{batch}", class_names(), batch * (repeats + 1))
            base = {"model": model, "bundle": str(bundle), "data": str(data), "batch": batch,
                    "text_cache": str(work / "text-cache"),
                    "device": options.device, "repeats": repeats}
            for label, segments in CHECKPOINTING.items():
                result = measure({**base, "kind": "edge", "segments": segments}, options.threads)
                section.rows.append(make_row("edge LoRA (train.pt2)", batch, f"checkpointing {label}", result))
            result = measure({**base, "kind": "promptformer"}, options.threads)
            section.rows.append(make_row("PromptFormer (local_train)", batch, "-", result))
    add_summary(section, batches)
    section.seconds = time.perf_counter() - began
    return section


def make_row(runtime: str, batch: int, variant: str, result: dict) -> dict:
    """One flat row of the table from a worker's result."""
    seconds = result.get("seconds_per_step")
    row = {"runtime": runtime, "variant": variant, "batch": batch, "segments": result.get("segments_used"),
           "seconds_per_step": seconds, "ms_per_image": None if seconds is None else 1000 * seconds / batch,
           "activation_mb": result.get("activation_mb"), "baseline_mb": result.get("baseline_mb"),
           "steps_timed": result.get("steps_timed")}
    for key in ("peak_rss_mb", "peak_gpu_mb"):
        if key in result:
            row[key] = result[key]
    if "error" in result:
        row["error"] = result["error"]
    return row


def add_summary(section: Section, batches: tuple[int, ...]) -> None:
    """Ratios per batch (checkpointing's memory saving and time cost, PromptFormer vs edge) and the goal."""
    def find(runtime_prefix: str, batch: int, variant: str) -> dict:
        return next(r for r in section.rows if r["runtime"].startswith(runtime_prefix) and r["batch"] == batch
                    and r["variant"] == variant)

    for batch in batches:
        off, on = find("edge", batch, "checkpointing off"), find("edge", batch, "checkpointing auto")
        full = find("PromptFormer", batch, "-")
        saving = ratio(off["activation_mb"], on["activation_mb"])
        section.ratios[f"batch {batch}: activation memory, checkpointing off/auto"] = saving
        section.ratios[f"batch {batch}: step time, checkpointing auto/off"] = ratio(on["seconds_per_step"],
                                                                                    off["seconds_per_step"])
        section.ratios[f"batch {batch}: step time, PromptFormer/edge LoRA"] = ratio(full["seconds_per_step"],
                                                                                    off["seconds_per_step"])
        section.ratios[f"batch {batch}: activation memory, PromptFormer/edge LoRA"] = ratio(
            full["activation_mb"], off["activation_mb"])
        section.goals.append(Goal.at_least(f"checkpointing halves peak activation memory, batch {batch}",
                                           saving, 2.0))
    section.notes.append("edge rows: edge_client.train.train_local on the exported train.pt2 (checkpoint_segments "
                         "1 = off, 0 = auto); PromptFormer rows: fedmvp.federated.task.local_train, lora_active "
                         "False. activation_mb: peak during the measured step minus memory in use before it.")


def show(section: Section) -> None:
    """A readable table."""
    memory_key = "peak_gpu_mb" if section.config.get("device") == "cuda" else "peak_rss_mb"
    print(f"{section.config['model']}, {section.config['timed_steps']} timed step(s) after 1 warm-up; "
          f"bundle export {section.config.get('export_seconds')} s")
    print(f"{'runtime':<28} {'variant':<20} {'batch':>5} {'seg':>4} {'s/step':>8} {'ms/img':>8} "
          f"{'act MB':>8} {'peak MB':>8}")
    for r in section.rows:
        if "error" in r:
            print(f"{r['runtime']:<28} {r['variant']:<20} {r['batch']:>5} error: {r['error']}")
            continue
        print(f"{r['runtime']:<28} {r['variant']:<20} {r['batch']:>5} {str(r['segments'] or '-'):>4} "
              f"{r['seconds_per_step']:8.3f} {r['ms_per_image']:8.1f} {r['activation_mb']:8.1f} "
              f"{r.get(memory_key, 0.0):8.1f}")
    show_ratios(section)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1])
    return section_main(run, show, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
