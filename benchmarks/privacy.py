"""Edge accuracy against epsilon: the demo's edge task, private at three noise levels and not
(docs/benchmarks.md, "Edge accuracy against epsilon").

The demo's edge task (fedmvp_apps/cli/demo.py): a trained run's last round is exported, a device
trains the LoRA on 8 local images of each new class (128 on the demo) and its update is ingested
(`fedmvp ingest`) as the run's next round; accuracy is top-1 on the new classes' held-out test
images, 40-way over every baked class, with the ingested round's LoRA.

Differential privacy needs more than one sender: one device's clipped delta with noise z C on every
coordinate is all noise. So here the same 128 images are dealt, one at a time in (class, image)
order, to ``devices`` simulated devices (32 on the full run: 4 images of 4 classes each), the privacy
unit being a device: the noise on the mean of m clipped deltas shrinks as 1/m (with the demo's 6144
LoRA parameters its norm is about z C sqrt(6144) / m, against a signal of at most C). Each round every device trains the round's bundle
(``edge_client.train.train_local``, the demo's recipe), its update file is ingested
(``fedmvp.federated.ingest.ingest``), and each device refreshes its bundle to the new round
(``edge_client.refresh.refresh_bundle``, what an edge node does). The same protocol runs without
``[privacy]`` (the non-private figure) and with it at three noise multipliers z, on copies of the
run; the devices' seeds are the same in all of them, so the figures are paired.

Mode: ``central`` is the headline (the server adds N(0, (z C / m)^2) to the mean of the m clipped
deltas, ``fedmvp.federated.aggregate``): at the same epsilon its noise on the mean is sqrt(m) times
smaller than ``local`` mode's (each device adds z C itself), and it is what a server that may see
clipped deltas offers. The full run measures ``local`` too (the mode for update files from devices
that trust no one). Epsilon at delta 1e-5 is what the run itself records for the last round
(``fedmvp.federated.privacy_budget``: Google's dp-accounting, an ingest round being a Gaussian
mechanism with q = 1): never a formula of ours. ``clip_norm`` C is the median norm of the
non-private devices' first-round deltas (a tuned hyper-parameter, as in DP-FedAvg; its choice is not
accounted). The central noise is fresh OS entropy: one draw per setting, so a figure moves by a
point or two between runs.

Writes ``privacy.png`` (accuracy against epsilon) into ``--out`` and, with ``--run``, into the run.
Goal (reported): within 3 points of the non-private edge accuracy at epsilon <= 8.

    python -m benchmarks privacy --run runs/demo-X   # the demo's run; without --run the newest runs/demo-*,
                                                     # else the demo preset is trained first (minutes)
    python -m benchmarks privacy --quick             # a 1-round run of the demo's smallest federation
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, Goal, Options, Section, save_figure  # noqa: E402
from benchmarks.sections_cli import section_main  # noqa: E402

DELTA = 1e-5  # the papers' delta (FedASK, FedSVD report epsilon 1, 3, 6 at 1e-5)
EPSILON_BOUND = 8.0  # the goal: within GOAL_POINTS of non-private at epsilon <= 8
GOAL_POINTS = 3.0
SHOTS = 8  # local images per new class, as `fedmvp demo` (16 new classes: 128 images)


@dataclass(frozen=True)
class Plan:
    """How the 128 images are trained: devices, rounds, local epochs, the noise levels and modes."""

    devices: int
    rounds: int
    epochs: int  # local epochs per round (the demo's one device trains 20 once)
    noise: tuple[float, ...]
    modes: tuple[str, ...]


PLANS = {"full": Plan(devices=32, rounds=3, epochs=10, noise=(0.8, 1.2, 2.0), modes=("central",)),
         "quick": Plan(devices=4, rounds=2, epochs=2, noise=(1.0, 2.0, 4.0), modes=("central",))}
QUICK_RUN_ROUNDS = 1


# ---- the trained run and its copies -----------------------------------------------------------------------
def trained_run(options: Options, work: Path) -> tuple[Path, str]:
    """The run to start from and where it came from: ``--run``; else (full) the newest runs/demo-*; else
    the demo preset trained here (with --quick its smallest federation, one round)."""
    from benchmarks.edge import newest_demo_run

    if options.run:
        return Path(options.run), "given (--run)"
    found = None if options.quick else newest_demo_run(Path.cwd())
    if found:
        return found, "the newest runs/demo-*"
    from benchmarks.flower import preset_file
    from fedmvp_apps.cli.train import train_or_resume

    if options.quick:
        preset, rounds, label = str(preset_file(work, quick=True)), QUICK_RUN_ROUNDS, "demo preset, quick override"
    else:
        preset, rounds, label = "demo", None, "demo preset"
    run = train_or_resume(preset, rounds, str(work / "trained"), resume=False, eval_every=0, device="cpu",
                          progress=False, command="python -m benchmarks privacy")
    return run.path, f"trained here ({label}, {rounds or 'its'} rounds)"


def copy_run(source: Path, dest: Path, privacy) -> "RunDir":  # noqa: F821 - fedmvp imported lazily
    """The run's record and its last round only, under ``[privacy]`` ``privacy`` (None: none): the
    experiment writes its rounds there, never into the run it was given."""
    from fedmvp.runs import ROUND_PREFIX, RunDir, round_dir_name

    run = RunDir(source)
    keep = {round_dir_name(trained_round(run))}
    shutil.copytree(source, dest, ignore=lambda folder, names: [
        n for n in names if Path(folder) == source and (n.startswith(ROUND_PREFIX) and n not in keep
                                                         or n in ("edge", "bundle") or n.startswith("bundle-"))])
    copy = RunDir(dest)
    config = {k: v for k, v in copy.read_config().items() if k != "privacy"}
    copy.write_config({**config, **({"privacy": privacy.record()} if privacy is not None else {})})
    return copy


def trained_round(run) -> int:
    """The run's last trained round: the last whose state.json is not an ingest's (a `fedmvp demo` run ends
    with its device's ingested round; the edge task starts from the round the demo exported)."""
    from fedmvp.federated.ingest import SOURCE

    for number in reversed(run.rounds()):
        if run.round_state(number).get("source") != SOURCE:
            return number
    raise RuntimeError(f"{run.path}: no complete trained round to start from")


def deal(local: Path, dest: Path, devices: int) -> list[Path]:
    """The local images dealt round-robin in (class, image) order to ``devices`` ImageFolder trees, so
    each device holds about as many images of as many classes as the others."""
    files = [f for folder in sorted(p for p in local.iterdir() if p.is_dir()) for f in sorted(folder.glob("*.png"))]
    if len(files) < devices:
        raise RuntimeError(f"{local}: {len(files)} images cannot be dealt to {devices} devices")
    trees = [dest / f"device-{k:02d}" for k in range(devices)]
    for index, file in enumerate(files):
        target = trees[index % devices] / file.parent.name
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, target / file.name)
    return trees


# ---- one protocol: rounds of devices, ingest, refresh ----------------------------------------------------
def round_tensors(run, round_number: int) -> dict:
    """What an edge node receives for a round: its ``promptformer.*`` and ``lora.*`` tensors (numpy)."""
    from fedmvp.federated.wire import to_numpy_state
    from fedmvp_formats.names import LORA_PREFIX, PROMPTFORMER_PREFIX

    tensors = run.load_checkpoint(round_number).tensors
    return to_numpy_state({k: v for k, v in tensors.items() if k.startswith((LORA_PREFIX, PROMPTFORMER_PREFIX))})


def protocol(run, bundle: Path, devices: list[Path], held_out: Path, plan: Plan, privacy, updates: Path,
             seed: int = 0) -> dict:
    """``plan.rounds`` rounds: every device trains ``bundle`` (privately when ``privacy``), the updates are
    ingested into ``run``, the bundle refreshed to the new round; held-out top-1 and epsilon per round."""
    from edge_client.bundle import read_bundle
    from edge_client.infer import infer_paths
    from edge_client.refresh import refresh_bundle
    from edge_client.train import train_local
    from fedmvp.federated.ingest import ingest
    from fedmvp.federated.privacy_budget import round_privacy
    from fedmvp_apps.cli.demo import EDGE_BATCH, EDGE_TRAIN
    from fedmvp_formats.bundle_manifest import DEVICE_ID_FILE
    from fedmvp_formats.privacy import delta_norm
    from fedmvp_formats.promptformer import promptformer_digest

    recipe = {**EDGE_TRAIN, "epochs": plan.epochs}
    rounds = []
    for number in range(1, plan.rounds + 1):
        start = read_bundle(bundle).lora()
        files, norms = [], []
        for k, data in enumerate(devices):
            # one bundle folder stands for every device here: device k's id is put in it before k trains, so
            # each update names its own device (a private ingest takes one update per device: ingest_devices)
            (Path(bundle) / DEVICE_ID_FILE).write_text(f"{k + 1:032x}\n")
            result = train_local(str(data), bundle, out=str(updates / f"round-{number}-device-{k:02d}.safetensors"),
                                 batch_size=EDGE_BATCH, start="bundle", apply=False, seed=seed + 1000 * number + k,
                                 privacy=privacy, **recipe)
            files.append(result.update_path)
            norms.append(result.privacy["delta_norm"] if result.privacy else
                         delta_norm({n: result.tensors[n] - start[n] for n in start}))
        fed = ingest(run, files)
        if fed.round is None:
            raise RuntimeError(f"fedmvp ingest refused the devices' updates: {fed.rejected[0].reason}")
        tensors = round_tensors(run, fed.round)
        refresh_bundle(read_bundle(bundle), tensors, digest=promptformer_digest(tensors), round_number=fed.round)
        spent = round_privacy(run, fed.round)
        rounds.append({"round": number, "edge_acc": infer_paths([str(held_out)], bundle, personalised=False).accuracy(),
                       "epsilon": spent["epsilon"] if spent else None, "dp_rounds": spent["dp_rounds"] if spent else 0,
                       "median_delta_norm": statistics.median(norms)})
    return {"rounds": rounds, "edge_acc": rounds[-1]["edge_acc"], "epsilon": rounds[-1]["epsilon"]}


def demo_reference(source: Path, work: Path) -> float:
    """The demo's own figure on a copy of the run (``run_edge_demo``): one device trains all the images
    (20 epochs) once, its update is ingested, no privacy; top-1 of the round it fed."""
    from fedmvp_apps.cli.demo import run_edge_demo

    return run_edge_demo(copy_run(source, work / "run-demo", None)).fed_accuracy


# ---- the section -------------------------------------------------------------------------------------------
def run(options: Options) -> Section:
    """The non-private protocol, then each mode at each noise level; rows, keys, the goal and the plot."""
    import logging
    import warnings

    from export.bundle_writer import ExportOptions, export_bundle
    from edge_client.infer import infer_paths
    from fedmvp_apps.cli.demo import new_class_folders
    from fedmvp_formats.privacy import PrivacyRecord

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    began = time.perf_counter()
    plan = PLANS["quick" if options.quick else "full"]
    with tempfile.TemporaryDirectory(prefix="fedmvp-bench-privacy-") as tmp:
        work = Path(tmp)
        source, origin = trained_run(options, work)
        base = copy_run(source, work / "run-base", None)
        start_round = trained_round(base)
        local, held_out, classes = new_class_folders(base, SHOTS)
        exported = export_bundle(base.path, out=work / "bundle", options=ExportOptions(parity_images=32))
        before = infer_paths([str(held_out)], exported.path, personalised=False).accuracy()
        devices = deal(local, work / "devices", plan.devices)
        held = sum(1 for _ in held_out.rglob("*.png"))

        def one(label: str, privacy) -> dict:
            run_copy = copy_run(source, work / f"run-{label}", privacy)
            bundle = work / f"bundle-{label}"
            shutil.copytree(exported.path, bundle)
            (work / f"updates-{label}").mkdir()
            result = protocol(run_copy, bundle, devices, held_out, plan, privacy, work / f"updates-{label}")
            print(f"[privacy] {label}: epsilon {result['epsilon']}, top-1 by round "
                  f"{[round(r['edge_acc'], 4) for r in result['rounds']]}", file=sys.stderr, flush=True)
            return result

        nonprivate = one("nonprivate", None)
        clip = nonprivate["rounds"][0]["median_delta_norm"]
        private = {(mode, z): one(f"{mode}-z{z:g}", PrivacyRecord(clip_norm=clip, noise_multiplier=z,
                                                                   target_delta=DELTA, mode=mode, max_epsilon=None))
                   for mode in plan.modes for z in plan.noise}
        demo = None if options.quick else demo_reference(source, work)
    section = Section("privacy", config={
        "run": str(source), "run_origin": origin, "start_round": start_round, "new_classes": len(classes), "local_images": SHOTS * len(classes),
        "held_out_images": held, "devices": plan.devices, "rounds": plan.rounds, "epochs_per_round": plan.epochs,
        "clip_norm": clip, "target_delta": DELTA, "modes": list(plan.modes), "noise_multipliers": list(plan.noise),
        "accountant": "dp-accounting RDP (fedmvp.federated.privacy_budget), q = 1 per ingest round"})
    section.rows.append(_row("none", None, nonprivate, before))
    section.rows += [_row(mode, z, result, before) for (mode, z), result in private.items()]
    fill(section, nonprivate, private, before, demo)
    section.seconds = round(time.perf_counter() - began, 1)
    plot(section, [p for p in (options.out, options.run) if p] or [default_out()])
    return section


def _row(mode: str, z: float | None, result: dict, before: float) -> dict:
    return {"mode": mode, "noise_multiplier": z, "epsilon": result["epsilon"], "edge_acc": result["edge_acc"],
            "acc_by_round": " ".join(f"{100 * r['edge_acc']:.1f}" for r in result["rounds"]),
            "edge_acc_before": before}


def fill(section: Section, nonprivate: dict, private: dict, before: float, demo: float | None) -> None:
    """The JSON keys: ``edge_acc_nonprivate``, ``edge_acc_at_eps`` (every mode and z), and the central
    drop (points) at the largest epsilon <= 8, the goal's figure."""
    section.config["edge_acc_at_eps"] = [
        {"mode": mode, "noise_multiplier": z, "epsilon": result["epsilon"], "edge_acc": result["edge_acc"],
         "by_round": result["rounds"]} for (mode, z), result in private.items()]
    section.ratios["edge_acc_nonprivate"] = nonprivate["edge_acc"]
    section.ratios["edge_acc_before_training"] = before
    section.ratios["edge_acc_demo_one_device"] = demo
    section.ratios["edge_gain_nonprivate_points"] = 100 * (nonprivate["edge_acc"] - before)
    for mode in dict.fromkeys(m for m, _ in private):
        within = [r for (m, _), r in private.items() if m == mode and r["epsilon"] <= EPSILON_BOUND]
        best = max(within, key=lambda r: r["epsilon"]) if within else None
        key = "privacy_accuracy_drop_points_at_eps_le_8" + ("" if mode == "central" else f"_{mode}")
        section.ratios[key] = None if best is None else 100 * (nonprivate["edge_acc"] - best["edge_acc"])
        section.ratios[f"epsilon_{mode}_le_8"] = None if best is None else best["epsilon"]
    drop = section.ratios.get("privacy_accuracy_drop_points_at_eps_le_8")
    section.goals.append(Goal.at_most(f"edge accuracy drop at epsilon <= {EPSILON_BOUND:g} (central), points", drop,
                                      GOAL_POINTS, " pts"))
    if section.ratios["edge_gain_nonprivate_points"] <= GOAL_POINTS:
        section.notes.append(f"the non-private protocol gains only {section.ratios['edge_gain_nonprivate_points']:.1f} "
                             f"points over the untrained bundle: the goal is met or missed by noise, not by learning")
    section.notes.append(f"{section.config['devices']} devices share the {section.config['local_images']} local "
                         f"images; {section.config['rounds']} ingest rounds of {section.config['epochs_per_round']} "
                         f"local epochs; clip_norm {section.config['clip_norm']:.3g} = the median first-round "
                         f"delta norm without privacy; one noise draw per setting (OS entropy)")


def default_out() -> Path:
    return REPO / "benchmarks" / "results" / time.strftime("privacy-%Y%m%d-%H%M%S")


def plot(section: Section, folders: list[Path]) -> None:
    """privacy.png: held-out top-1 against epsilon per mode, the non-private level and its 3-point band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = section.ratios
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for mode in section.config["modes"]:
        points = sorted((p["epsilon"], 100 * p["edge_acc"], p["noise_multiplier"])
                        for p in section.config["edge_acc_at_eps"] if p["mode"] == mode)
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=f"{mode} DP")
        for eps, acc, z in points:
            ax.annotate(f"z={z:g}", (eps, acc), textcoords="offset points", xytext=(4, 4), fontsize=7)
    top = 100 * r["edge_acc_nonprivate"]
    ax.axhline(top, color="k", label="non-private")
    ax.axhspan(top - GOAL_POINTS, top, color="g", alpha=0.12, label=f"within {GOAL_POINTS:g} points")
    ax.axhline(100 * r["edge_acc_before_training"], color="grey", ls=":", label="before edge training")
    if r.get("edge_acc_demo_one_device") is not None:
        ax.axhline(100 * r["edge_acc_demo_one_device"], color="b", ls="-.", lw=0.8, label="the demo's one device")
    ax.axvline(EPSILON_BOUND, color="r", ls="--", lw=0.8, label=f"epsilon = {EPSILON_BOUND:g}")
    ax.set_xscale("log")
    ax.set_xlabel(f"epsilon at delta {DELTA:g} (dp-accounting, RDP)")
    ax.set_ylabel("held-out top-1 on new classes (%)")
    ax.set_title(f"edge accuracy vs privacy ({section.config['devices']} devices, {section.config['rounds']} rounds)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    section.config["plots"] = save_figure(fig, folders, "privacy.png")


def show(section: Section) -> None:
    from benchmarks.sections_cli import show_table

    c = section.config
    print(f"run {c['run']} ({c['run_origin']}): {c['devices']} devices x {c['local_images'] // c['devices']} images, "
          f"{c['rounds']} rounds, clip_norm {c['clip_norm']:.3g}, delta {c['target_delta']:g}")
    show_table(section)
    print("plot: " + ", ".join(c["plots"]))


def main(argv: list[str] | None = None) -> int:
    return section_main(run, show, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
