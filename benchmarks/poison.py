"""Poisoned updates against the server's update rules: the demo's edge task with malicious devices
(docs/benchmarks.md, "Poisoned updates").

The demo's edge task as ``benchmarks/privacy.py`` runs it (its helpers: the trained run, its copies, the
128 local new-class images dealt to ``devices`` simulated devices), one round: every device trains the
exported bundle once (``edge_client.train.train_local``, the demo's recipe: what `edge-client train`
runs), and the update files are ingested (``fedmvp.federated.ingest.ingest``, what `fedmvp ingest` runs).
Devices 0 .. m-1 are malicious, m = 1 and 2 of 10, with the attacks of ``benchmarks.poison_attacks``:
a backdoor trained into the attacker's LoRA, its honest delta scaled, its honest delta negated, the backdoor
boosted, the backdoor claiming the most examples the run accepts; then the boosted backdoor's file, once taken,
replayed into the next round three ways (``replay_round``).

Devices train once per attack; each update rule of the registry present at run time
(``fedmvp.federated.update_rules.UPDATE_RULES``) then aggregates the same files, on its own copy of the
run with ``[server] update_rule`` (and the rule's knobs, ``RULE_KNOBS``) set in the copy's server record:
the path a real ingest takes, recording what the rule screened in the round's state.json ("screened").
The ingested round's LoRA is judged on the exported bundle: clean top-1 on the new classes' held-out
images (40-way, as `fedmvp demo` reports it; the edge task has no base classes, so no HM), and attack
success, the share of triggered held-out images of the other classes classified as the target.

    python -m benchmarks poison --run runs/demo-X   # without --run the newest runs/demo-*, else the demo is trained
    python -m benchmarks poison --quick             # a 1-round run of the demo's smallest federation, 5 devices
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, Options, Section, save_figure  # noqa: E402
from benchmarks.sections_cli import section_main  # noqa: E402

SHOTS = 8  # local images per new class, as `fedmvp demo`
# A rule's knobs in the benchmark (only those this fedmvp's [server] record knows are set): Multi-Krum is
# told the largest number of attackers the benchmark runs; the trimmed mean trims that share of 10.
RULE_KNOBS = {"multi_krum": {"assumed_malicious": 2}, "trimmed_mean": {"trim_fraction": 0.2}}
UNCAPPED = "fedavg_uncapped"  # FedAvg with no cap on claimed example counts: the claimed-count attack's no-defence row
CLAIMED = "backdoor_claimed"


@dataclass(frozen=True)
class Plan:
    """How many devices, how many of them malicious, local epochs, the scaling attack's factor."""

    devices: int
    malicious: tuple[int, ...]
    epochs: int
    attacker_epochs: int  # the backdoor attacker's own recipe: more epochs at ATTACKER_LR
    scale: float


PLANS = {"full": Plan(devices=10, malicious=(1, 2), epochs=10, attacker_epochs=20, scale=20.0),
         "quick": Plan(devices=5, malicious=(1,), epochs=2, attacker_epochs=10, scale=20.0)}
BACKDOORS = ("none", "backdoor", "backdoor_boosted", CLAIMED)  # the settings whose triggered images are judged
ATTACKER_LR = 0.1  # `edge-client train --lr 0.1`: at the demo's 0.01 the LoRA does not learn the trigger


def rule_names() -> list[str]:
    """The update rules registered now, the default first."""
    from fedmvp.federated.update_rules import DEFAULT_RULE, UPDATE_RULES

    return [DEFAULT_RULE] + sorted(n for n in UPDATE_RULES if n != DEFAULT_RULE)


def rule_record(name: str, plan: Plan) -> dict[str, Any]:
    """``[server]`` keys that select rule ``name`` for the devices' round with the benchmark's knobs (those
    the record knows); ``UNCAPPED``: FedAvg with ``count_cap`` 0."""
    from fedmvp.presets.server import ServerSpec

    if name == UNCAPPED:
        return {"update_rule": "fedavg", "device_rule": "fedavg", "count_cap": 0}
    knobs = dict(RULE_KNOBS.get(name, {}))
    if "assumed_malicious" in knobs:
        knobs["assumed_malicious"] = max(plan.malicious)
    return {"update_rule": name, "device_rule": name, **{k: v for k, v in knobs.items() if k in ServerSpec.keys()}}


def default_device_rule() -> str:
    """The rule an ingested round of devices goes through when the run sets none (docs/howto/robust.md)."""
    from fedmvp.federated.update_rules import device_rule_name
    from fedmvp.presets.server import ServerSpec

    return device_rule_name(ServerSpec(), None)


# ---- the devices' update files ---------------------------------------------------------------------------
def train(data: Path, bundle: Path, out: Path, epochs: int, seed: int, **recipe: Any) -> Any:
    """One device's training of ``bundle`` on ``data`` (the demo's recipe, ``epochs`` local epochs, what
    ``recipe`` overrides)."""
    from edge_client.train import train_local
    from fedmvp_apps.cli.demo import EDGE_BATCH, EDGE_TRAIN

    return train_local(str(data), bundle, out=str(out), batch_size=EDGE_BATCH, start="bundle", apply=False,
                       seed=seed, privacy=None, **{**EDGE_TRAIN, "epochs": epochs, **recipe})


def update_files(work: Path, devices: list[Path], bundle: Path, target: str, plan: Plan,
                 claimed: int) -> dict[str, Any]:
    """Every device's honest update, and the attackers' files of each attack (devices 0 .. max m - 1)."""
    from edge_client.bundle import read_bundle

    from benchmarks.poison_attacks import backdoor_folder, crafted_update

    opened = read_bundle(bundle)
    start = opened.lora()
    (work / "updates").mkdir()
    honest = [train(data, bundle, work / "updates" / f"honest-{k:02d}.safetensors", plan.epochs, 1000 + k)
              for k, data in enumerate(devices)]
    attackers = range(max(plan.malicious))
    attacks = {"backdoor": [train(backdoor_folder(devices[k], work / "backdoor" / f"device-{k:02d}", target), bundle,
                                  work / "updates" / f"attacker-backdoor-{k:02d}.safetensors", plan.attacker_epochs,
                                  1000 + k, lr=ATTACKER_LR) for k in attackers]}
    for attack, factor in (("scaling", plan.scale), ("sign_flip", -1.0)):
        attacks[attack] = [crafted_update(work / "updates" / f"attacker-{attack}-{k:02d}.safetensors", opened, start,
                                          honest[k].tensors, factor, honest[k].num_examples, honest[k].mean_loss)
                           for k in attackers]
    # Model replacement (Bagdasaryan et al.): the backdoor's delta boosted by the devices of a round, so that
    # FedAvg's 1/n share of it is the whole trained backdoor.
    attacks["backdoor_boosted"] = [
        crafted_update(work / "updates" / f"attacker-backdoor_boosted-{k:02d}.safetensors", opened, start,
                       trained.tensors, float(plan.devices), trained.num_examples, trained.mean_loss)
        for k, trained in zip(attackers, attacks["backdoor"])]
    attacks[CLAIMED] = [  # the trained backdoor as it is, claiming ``claimed`` examples (edge_max_examples)
        crafted_update(work / "updates" / f"attacker-{CLAIMED}-{k:02d}.safetensors", opened, start, trained.tensors,
                       1.0, claimed, trained.mean_loss) for k, trained in zip(attackers, attacks["backdoor"])]
    return {"start": start, "honest": honest, "attacks": attacks}


def settings(made: dict[str, Any], plan: Plan) -> dict[tuple[str, int], list[Path]]:
    """(attack, m) -> the round's files: the m attackers' files in place of their honest ones."""
    honest = [r.update_path for r in made["honest"]]
    out = {("none", 0): honest}
    for attack, files in made["attacks"].items():
        for m in plan.malicious:
            out[(attack, m)] = [f if isinstance(f, Path) else f.update_path for f in files[:m]] + honest[m:]
    return out


# ---- one rule over one setting's files -------------------------------------------------------------------
def aggregate(source: Path, dest: Path, server: dict[str, Any], files: list[Path]) -> dict[str, Any]:
    """``files`` ingested into a copy of the run whose server record selects ``server``'s rule: the round's
    LoRA, what ingest refused and what the rule screened (state.json)."""
    from benchmarks.privacy import copy_run, round_tensors
    from fedmvp.federated.ingest import ingest
    from fedmvp.runs import RunError
    from fedmvp_formats.names import LORA_PREFIX

    copy = copy_run(source, dest, None)
    config = copy.read_config()
    copy.write_config({**config, "server": {**config.get("server", {}), **server}})
    try:
        fed = ingest(copy, files)
    except RunError as err:
        return {"error": str(err).splitlines()[0]}
    if fed.round is None:
        return {"error": f"every file refused: {fed.rejected[0].reason}"}
    state = copy.round_state(fed.round)
    lora = {k: v for k, v in round_tensors(copy, fed.round).items() if k.startswith(LORA_PREFIX)}
    return {"lora": lora, "screened": state.get("screened") or [],
            "refused": [{"file": Path(v.file).name, "reason": v.reason} for v in fed.rejected],
            "clipped": [Path(v.file).name for v in fed.accepted if v.clipped_from is not None],
            "weights": {Path(v.file).name: v.weight for v in fed.accepted}}


def replay_round(work: Path, judge: Any, made: dict[str, Any], rule: str) -> dict[str, Any]:
    """The boosted backdoor's file, taken into round R+1 of the run where ``rule`` aggregated it with one
    attacker, replayed three ways into round R+2 (``poison_attacks.replays``): which were accepted, why the
    others were refused, and the backdoor's success on the LoRA written after (where one was)."""
    from benchmarks.poison_attacks import replays
    from benchmarks.privacy import round_tensors
    from fedmvp.federated.ingest import ingest
    from fedmvp.runs import RunDir
    from fedmvp_formats.names import LORA_PREFIX

    run = RunDir(work / f"run-backdoor_boosted-1-{rule}")
    taken = run.last_round()
    files = replays(made["attacks"]["backdoor_boosted"][0], work / "replays", taken, round_tensors(run, taken))
    fed = ingest(run, list(files.values()))
    accepted = {Path(v.file).name for v in fed.accepted}
    out = {"rule": rule, "into_round": taken + 1, "offered": len(files),
           "accepted": [name for name, path in files.items() if path.name in accepted],
           "refused": {name: next(v.reason for v in fed.rejected if v.file == str(path))
                       for name, path in files.items() if path.name not in accepted}}
    if fed.round is not None:
        lora = {k: v for k, v in round_tensors(run, fed.round).items() if k.startswith(LORA_PREFIX)}
        out["success_after"] = judge.success(lora)
    return out


def screened_attackers(screened: list[dict[str, Any]]) -> int:
    """How many screened entries name an attacker's file (its name holds ``attacker``)."""
    return sum(1 for entry in screened if "attacker" in " ".join(str(v) for v in entry.values()))


# ---- the section -------------------------------------------------------------------------------------------
def run(options: Options) -> Section:
    """Train the devices once per attack, aggregate with every rule, judge; rows, keys and the plot."""
    import logging
    import warnings

    from benchmarks.poison_attacks import Judge, delta_norm, triggered_held_out
    from benchmarks.privacy import copy_run, deal, trained_round, trained_run
    from export.bundle_writer import ExportOptions, export_bundle
    from fedmvp_apps.cli.demo import new_class_folders

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    began = time.perf_counter()
    plan = PLANS["quick" if options.quick else "full"]
    rules = rule_names()
    with tempfile.TemporaryDirectory(prefix="fedmvp-bench-poison-") as tmp:
        work = Path(tmp)
        source, origin = trained_run(options, work)
        base = copy_run(source, work / "run-base", None)
        local, held_out, classes = new_class_folders(base, SHOTS)
        target = classes[0]
        bundle = export_bundle(base.path, out=work / "bundle", options=ExportOptions(parity_images=32)).path
        judge = Judge(bundle, held_out, triggered_held_out(held_out, work / "triggered", target), target)
        devices = deal(local, work / "devices", plan.devices)
        claimed = base.server().edge_max_examples  # the most examples an update file may claim in the run
        made = update_files(work, devices, bundle, target, plan, claimed)
        start, honest, backdoor = made["start"], made["honest"][0], made["attacks"]["backdoor"][0]
        before = judge.clean(start)  # the exported bundle's own LoRA: what the round starts from
        attacker = {"honest_target_rate": judge.success(honest.tensors),
                    "backdoor_target_rate": judge.success(backdoor.tensors),
                    "honest_clean": judge.clean(honest.tensors), "backdoor_clean": judge.clean(backdoor.tensors),
                    "honest_delta_norm": delta_norm(start, honest.tensors),
                    "backdoor_delta_norm": delta_norm(start, backdoor.tensors),
                    "honest_median_delta_norm": statistics.median(delta_norm(start, r.tensors) for r in made["honest"])}
        attacker["scaling_delta_norm"] = plan.scale * attacker["honest_delta_norm"]
        bound = base.server().max_update_norm  # the run's own bound: beyond it ingest rejects or clips
        attacker["max_update_norm"] = bound
        attacker["scaling_beyond_max_update_norm"] = None if bound is None else attacker["scaling_delta_norm"] > bound
        print(f"[poison] attacker's own LoRA: triggered -> target {attacker['backdoor_target_rate']:.3f} "
              f"(honest {attacker['honest_target_rate']:.3f})", file=sys.stderr, flush=True)
        results = {}
        for (attack, m), files in settings(made, plan).items():
            for rule in rules + ([UNCAPPED] if attack == CLAIMED else []):
                found = aggregate(source, work / f"run-{attack}-{m}-{rule}", rule_record(rule, plan), files)
                if "lora" in found:
                    lora = found.pop("lora")
                    found["clean"] = judge.clean(lora)
                    found["success"] = judge.success(lora) if attack in BACKDOORS else None
                results[(attack, m, rule)] = found
            print(f"[poison] {attack} {m}/{plan.devices} done", file=sys.stderr, flush=True)
        replayed = replay_round(work, judge, made, default_device_rule())
        start_round = trained_round(base)
    section = Section("poison", config={
        "run": str(source), "run_origin": origin, "start_round": start_round, "devices": plan.devices,
        "malicious": list(plan.malicious), "epochs": plan.epochs, "attacker_epochs": plan.attacker_epochs,
        "attacker_lr": ATTACKER_LR, "scale_factor": plan.scale, "target_class": target,
        "rules": rules, "rule_settings": {r: rule_record(r, plan) for r in rules}, "attacker_local": attacker,
        "new_classes": len(classes), "hm": "not applicable: the edge task's held-out images are new classes only",
        "default_device_rule": default_device_rule(), "claimed_examples": claimed,
        "replays": replayed})
    section.ratios["clean_acc_before_training"] = before
    fill(section, results, rules, plan)
    section.seconds = round(time.perf_counter() - began, 1)
    plot(section, [p for p in (options.out, options.run) if p] or [default_out()])
    return section


def fill(section: Section, results: dict[tuple[str, int, str], dict], rules: list[str], plan: Plan) -> None:
    """One row per (attack, m, rule) and the keys. Points are against FedAvg with no attacker. The best rule
    is the one with the least backdoor success at 1 malicious device (ties: the higher clean accuracy)."""
    from fedmvp.presets.server import ServerSpec

    def clean(attack: str, m: int, rule: str) -> float | None:
        return results.get((attack, m, rule), {}).get("clean")

    reference = clean("none", 0, "fedavg")
    for (attack, m, rule), found in results.items():
        value = found.get("clean")
        section.rows.append({
            "attack": attack, "malicious": f"{m} of {plan.devices}", "rule": rule, "clean_acc": value,
            "attack_success": found.get("success"), "attacker_weight": None if attack == "none" else sum(
                w or 0.0 for name, w in found.get("weights", {}).items() if "attacker" in name),
            "clean_drop_points": None if value is None or reference is None else 100 * (reference - value),
            "screened": len(found.get("screened", [])),
            "screened_attackers": screened_attackers(found.get("screened", [])),
            "refused_by_ingest": len(found.get("refused", [])), "clipped_by_ingest": len(found.get("clipped", [])),
            "error": found.get("error")})
    section.config["results"] = [{"attack": a, "malicious": m, "rule": r, **found}
                                 for (a, m, r), found in results.items()]
    section.config["rule_cost_points_no_attack"] = {
        r: None if clean("none", 0, r) is None or reference is None else 100 * (reference - clean("none", 0, r))
        for r in rules}
    one = {r: results.get(("backdoor", 1, r), {}) for r in rules}
    ranked = sorted((r for r in rules if one[r].get("success") is not None),
                    key=lambda r: (one[r]["success"], -(one[r].get("clean") or 0.0)))
    best = ranked[0] if ranked else None
    section.config["best_rule"] = best
    default = section.config.get("default_device_rule") or ServerSpec().update_rule
    r = section.ratios
    r["backdoor_success_no_defence"] = one.get("fedavg", {}).get("success")
    r["backdoor_success_best_rule"] = None if best is None else one[best]["success"]
    r["clean_drop_points_best_rule"] = (None if best is None or reference is None or one[best].get("clean") is None
                                        else 100 * (reference - one[best]["clean"]))
    r["default_rule_cost_points_no_attack"] = section.config["rule_cost_points_no_attack"].get(default)
    boosted = {rule: results.get(("backdoor_boosted", 1, rule), {}) for rule in rules}
    hardest = sorted((rule for rule in rules if boosted[rule].get("success") is not None),
                     key=lambda rule: (boosted[rule]["success"], -(boosted[rule].get("clean") or 0.0)))
    section.config["best_rule_boosted"] = hardest[0] if hardest else None
    r["boosted_backdoor_success_no_defence"] = boosted.get("fedavg", {}).get("success")
    r["boosted_backdoor_success_best_rule"] = boosted[hardest[0]]["success"] if hardest else None
    r["boosted_backdoor_success_default_rule"] = boosted.get(default, {}).get("success")
    r["backdoor_success_default_rule"] = one.get(default, {}).get("success")
    claimed = {rule: results.get((CLAIMED, 1, rule), {}) for rule in [*rules, UNCAPPED]}
    r["claimed_count_success_no_defence"] = claimed[UNCAPPED].get("success")  # fedavg, no count cap
    r["claimed_count_success_fedavg_capped"] = claimed.get("fedavg", {}).get("success")
    r["claimed_count_success_default_rule"] = claimed.get(default, {}).get("success")
    replayed = section.config.get("replays") or {}
    r["replays_accepted"] = len(replayed.get("accepted", [])) if replayed else None
    r["clean_acc_no_attack_fedavg"] = reference
    r["backdoor_success_no_attacker_fedavg"] = results.get(("none", 0, "fedavg"), {}).get("success")
    attacker = section.config["attacker_local"]
    r["attacker_local_backdoor_target_rate"] = attacker["backdoor_target_rate"]
    r["attacker_local_honest_target_rate"] = attacker["honest_target_rate"]
    section.notes.append(f"the devices' default rule (no [server] key set): {default}; claimed count: the "
                         f"backdoor claiming {section.config.get('claimed_examples')} examples; replays of the "
                         f"boosted backdoor into the next round accepted: {r['replays_accepted']} of "
                         f"{replayed.get('offered')}")
    section.notes.append(f"one round, {plan.devices} devices x {plan.epochs} local epochs; attackers are devices "
                         f"0 .. m-1; scaling x{plan.scale:g}, sign flipping x-1 of the attacker's honest delta; "
                         f"backdoor target {section.config['target_class']}; best rule (least backdoor success at 1 of "
                         f"{plan.devices}): {best}; rules present: {', '.join(rules)}")
    if len(rules) == 1:
        section.notes.append("only the default rule is registered here: the table has no robust rule to compare")


def default_out() -> Path:
    return REPO / "benchmarks" / "results" / time.strftime("poison-%Y%m%d-%H%M%S")


def plot(section: Section, folders: list[Path]) -> None:
    """poison.png: clean top-1 (left) and backdoor success (right) per rule, one bar per attack setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rules = section.config["rules"]
    rows = section.rows
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key, wanted, title in ((left, "clean_acc", None, "clean top-1 on held-out new classes (%)"),
                                   (right, "attack_success", BACKDOORS,
                                    "triggered images classified as the target (%)")):
        shown = [s for s in dict.fromkeys((row["attack"], row["malicious"]) for row in rows)
                 if wanted is None or s[0] in wanted]
        width = 0.8 / max(1, len(shown))
        for i, (attack, m) in enumerate(shown):
            values = [next((100 * row[key] for row in rows if (row["attack"], row["malicious"], row["rule"]) ==
                            (attack, m, rule) and row[key] is not None), 0.0) for rule in rules]
            ax.bar([j + i * width for j in range(len(rules))], values, width,
                   label="no attack" if attack == "none" else f"{attack}, {m}")
        ax.set_xticks([j + width * (len(shown) - 1) / 2 for j in range(len(rules))], rules, fontsize=8)
        ax.set_ylabel(title)
        ax.legend(fontsize=7, loc="lower right", framealpha=0.9)
    fig.suptitle(f"poisoned updates: {section.config['devices']} devices, one ingest round")
    fig.tight_layout()
    section.config["plots"] = save_figure(fig, folders, "poison.png")


def show(section: Section) -> None:
    from benchmarks.sections_cli import show_table

    c, a = section.config, section.config["attacker_local"]
    print(f"run {c['run']} ({c['run_origin']}): {c['devices']} devices, {c['epochs']} local epochs, rules "
          f"{', '.join(c['rules'])}; the attacker's own LoRA sends {100 * a['backdoor_target_rate']:.1f}% of "
          f"triggered images to {c['target_class']} (honest {100 * a['honest_target_rate']:.1f}%)")
    show_table(section)
    print("plot: " + ", ".join(c["plots"]))


def main(argv: list[str] | None = None) -> int:
    return section_main(run, show, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
