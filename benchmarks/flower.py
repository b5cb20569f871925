"""Flower overhead: rounds on Flower's simulation engine against the same local work in a bare loop.

Flower: ``fedmvp.federated.simulation.simulate`` on a run prepared from the `demo` preset
(``fedmvp.federated.prepare.prepare_run``), exactly what ``fedmvp train``/``fedmvp demo`` run.
A round's time is read from the run's checkpoints (each written when its round is aggregated):
round 1 holds Ray's start, the workers' context build (CLIP, data, frozen targets) and the
zero-shot evaluation; the last round holds the final evaluation; the rounds between are pure
round trips. Hence 5 rounds (3 with --quick), and the ratio is the median over the rounds between.

Bare loop: no Flower, no Ray: the same clients, local settings, learning rate schedule and model
through the very function the ClientApp calls (``fedmvp.federated.task.local_train``), then the
server's ``weighted_average``, sequentially in this process. Its round 1 holds the context build.

The engine runs ``min(cores, clients)`` clients at once with ``cores // that`` torch threads each;
the bare loop runs them one after another with all cores. Ray's own cost is measured alone too:
``ray.init`` + ``ray.shutdown`` with the engine's arguments, in a fresh interpreter.

    python -m benchmarks.flower            # the demo preset, 5 rounds
    python -m benchmarks.flower --quick    # 2 clients, 1 local step each, 3 rounds (one measured)
"""

from __future__ import annotations

import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, Goal, Options, Section, ratio  # noqa: E402
from benchmarks.sections_cli import section_main, show_ratios  # noqa: E402

# Round 1: start-up; the last round: the final evaluation; the rounds between are measured (median).
ROUNDS = {"full": 5, "quick": 3}
# --quick: the fewest clients and steps the demo world allows: one class group (6 base classes) x the
# 2 training domains = 2 clients, 1 shot per class = 6 images = one local step of batch 16.
QUICK_TRAIN = {"local_epochs": 1, "shots": 1}
QUICK_DATASET = {"base_classes": 6}


# ---- the preset -------------------------------------------------------------------------------------------
def rounds_for(quick: bool) -> int:
    return ROUNDS["quick" if quick else "full"]


def preset_file(work: Path, quick: bool) -> Path:
    """The demo preset, with ``rounds`` set and, with --quick, the smallest federation it allows."""
    from fedmvp.presets.schema import preset_path

    text = preset_path("demo").read_text()
    text = set_key(text, "rounds", str(rounds_for(quick)))
    if quick:
        for key, value in {**QUICK_TRAIN, **QUICK_DATASET}.items():
            text = set_key(text, key, str(value))
    path = work / ("demo-quick.toml" if quick else "demo.toml")
    path.write_text(text)
    return path


def set_key(text: str, key: str, value: str) -> str:
    """Replace ``key = ...`` (first occurrence, comment dropped) in a TOML text; the key must be there."""
    new, count = re.subn(rf"(?m)^{key}\s*=.*$", f"{key} = {value}", text, count=1)
    if not count:
        raise KeyError(f"the demo preset has no {key!r}")
    return new


# ---- Flower -----------------------------------------------------------------------------------------------
def flower_rounds(preset: Path, work: Path, rounds: int, device: str) -> dict:
    """Seconds of each round of a simulated run (from its checkpoints' times), and the whole run."""
    from fedmvp.federated.prepare import prepare_run
    from fedmvp.federated.simulation import simulate

    run = prepare_run(str(preset), str(work / "run"), rounds, resume=False, device=device)
    config = run.read_config()
    began = time.time()
    simulate(run, eval_every=0, progress=False)
    total = time.time() - began
    marks = [began] + [run.round_state_path(r).stat().st_mtime for r in range(1, rounds + 1)]
    return {"round_seconds": [b - a for a, b in zip(marks, marks[1:])], "total_seconds": total,
            "clients": int(config["num_clients"]), "local": config["train"]}


def ray_start_seconds(cpus: int) -> dict:
    """``ray.init`` and ``ray.shutdown`` with the engine's arguments, alone, in a fresh interpreter."""
    code = ("import json, logging, time, ray\n"
            "t0 = time.perf_counter()\n"
            f"ray.init(num_cpus={cpus}, log_to_driver=False, logging_level=logging.ERROR, include_dashboard=False)\n"
            "t1 = time.perf_counter()\n"
            "ray.shutdown()\n"
            "print(json.dumps({'init_seconds': t1 - t0, 'shutdown_seconds': time.perf_counter() - t1}))\n")
    from fedmvp.federated.simulation import SIMULATION_ENV

    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, **SIMULATION_ENV},
                          capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": " ".join(done.stderr.split())[-300:]}
    return json.loads(lines[-1])


# ---- the bare loop ----------------------------------------------------------------------------------------
def bare_rounds(preset: Path, work: Path, rounds: int, device: str) -> dict:
    """The same rounds without Flower: every client's `local_train`, the server's average, and its
    checkpoint (fedmvp's own server work, also in the Flower rounds)."""
    from fedmvp.federated.prepare import prepare_run
    from fedmvp.federated.aggregate import weighted_average
    from fedmvp.federated.strategy import cosine_lr
    from fedmvp.federated.task import LocalSettings, local_train, task_context
    from fedmvp.federated.wire import to_numpy_state, to_torch_state

    run = prepare_run(str(preset), str(work / "bare"), rounds, resume=False, device=device)
    config = run.read_config()
    settings = LocalSettings.from_train(config["train"])
    times, lora_clients = [], set()
    began = time.perf_counter()
    ctx = task_context(run.preset_file(config), run.method(), config["client_device"])  # as each worker
    state = to_numpy_state(ctx.model.state("all"))
    for round_number in range(1, rounds + 1):
        lr = cosine_lr(float(config["lr"]), round_number, rounds)
        replies = []
        for client in ctx.federation.clients:
            result = local_train(ctx, client, to_torch_state(state), round_number, lr,
                                 client.client_id in lora_clients, settings)
            replies.append((to_numpy_state(result.state), float(result.num_examples)))
            if result.switch_next:
                lora_clients.add(client.client_id)
        state = {**state, **weighted_average(replies)}
        run.save_checkpoint(round_number, to_torch_state(state), {"lora_clients": sorted(lora_clients)})
        times.append(time.perf_counter() - began)
        began = time.perf_counter()
    return {"round_seconds": times}


def forget_contexts() -> None:
    """Drop this process's cached task contexts: the simulated run's server must build its own, with an
    untrained model, not reuse the one the bare loop trained."""
    from fedmvp.federated import task

    task._task_context.cache_clear()


# ---- the section ------------------------------------------------------------------------------------------
def run(options: Options) -> Section:
    """Flower rounds, bare-loop rounds, Ray alone; the overhead ratio on the rounds between the first and the last."""
    began = time.perf_counter()
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    with tempfile.TemporaryDirectory(prefix="fedmvp-bench-flower-") as tmp:
        work = Path(tmp)
        rounds = rounds_for(options.quick)
        preset = preset_file(work, options.quick)
        bare = bare_rounds(preset, work, rounds, options.device)  # first: builds the synthetic world if not cached
        forget_contexts()
        flower = flower_rounds(preset, work, rounds, options.device)
    cpus = max(1, min(os.cpu_count() or 1, flower["clients"]))
    ray_alone = ray_start_seconds(cpus)
    local = flower["local"]
    section = Section(name="flower", config={
        "preset": "demo" + (" (quick override)" if options.quick else ""), "rounds": rounds,
        "clients": flower["clients"], "local_epochs": local["local_epochs"], "batch_size": local["batch_size"],
        "shots": local["shots"], "engine_parallel_clients": cpus,
        "engine_threads_per_client": max(1, (os.cpu_count() or 1) // cpus), "model": "fedmvp-tiny (synthetic)"})
    for name, result in (("flower (simulation engine)", flower), ("bare loop", bare)):
        for number, seconds in enumerate(result["round_seconds"], start=1):
            kind = {1: "first (start-up)", rounds: "last (final evaluation)" if result is flower else "last"
                    }.get(number, "steady")
            section.rows.append({"runtime": name, "round": number, "kind": kind, "seconds": seconds})
    section.rows.append({"runtime": "ray.init alone", "round": None, "kind": "start",
                         "seconds": ray_alone.get("init_seconds")})
    section.rows.append({"runtime": "ray.shutdown alone", "round": None, "kind": "stop",
                         "seconds": ray_alone.get("shutdown_seconds")})
    steady = slice(1, rounds - 1)
    overhead = ratio(statistics.median(flower["round_seconds"][steady]),
                     statistics.median(bare["round_seconds"][steady]))
    section.ratios[f"steady rounds 2-{rounds - 1} (median): flower/bare"] = overhead
    section.ratios["round 1: flower/bare"] = ratio(flower["round_seconds"][0], bare["round_seconds"][0])
    section.ratios["whole run: flower/bare"] = ratio(flower["total_seconds"], sum(bare["round_seconds"]))
    section.goals.append(Goal.at_most("Flower round overhead (steady rounds, flower/bare)", overhead, 1.10))
    section.notes.append("flower rounds from checkpoint times; round 1 includes Ray start, the workers' context "
                         "build and the zero-shot evaluation; the last round the final evaluation (the bare loop "
                         "evaluates nothing); the ratio is on the rounds between (median). Both save a "
                         "checkpoint per round. The bare loop runs first: round 1 of the Flower run may find "
                         "the text-feature cache and the image files warm. The bare loop uses this process's "
                         "torch threads (--threads; default all cores), the engine 1 per client here. With "
                         "--quick (one step per client) the steady ratio is mostly warm-up noise.")
    if options.model:
        section.notes.append(f"--model {options.model} ignored: the demo preset's backbone is used")
    if "error" in ray_alone:
        section.notes.append(f"ray alone: {ray_alone['error']}")
    section.seconds = time.perf_counter() - began
    return section


def show(section: Section) -> None:
    """A readable table."""
    c = section.config
    print(f"{c['preset']}: {c['clients']} clients, {c['local_epochs']} local epoch(s) of batch {c['batch_size']}, "
          f"{c['shots']} shot(s); engine: {c['engine_parallel_clients']} clients at once")
    print(f"{'runtime':<28} {'round':>5} {'kind':<24} {'seconds':>8}")
    for r in section.rows:
        seconds = "-" if r["seconds"] is None else f"{r['seconds']:8.2f}"
        print(f"{r['runtime']:<28} {str(r['round'] or '-'):>5} {r['kind']:<24} {seconds:>8}")
    show_ratios(section)


def main(argv: list[str] | None = None) -> int:
    logging.getLogger("flwr").setLevel(logging.ERROR)
    return section_main(run, show, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
