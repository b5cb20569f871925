"""`fedmvp demo`: the whole flow on the embedded synthetic world, offline, in minutes.

Trains the `demo` preset (base classes cut into clients, new classes and one domain held out) on
Flower's simulation engine, writes ./runs/demo-<time>/ like any run, prints the paper-style
table (zero-shot vs tuned Local / Base / New / HM), then exports the last round and runs the
edge client on it, and closes the loop: the device's update file is ingested into the run as its
next round (``fedmvp ingest``), that round is exported, and the device's accuracy is shown on the
bundle before and after the round it fed. This module is the one place in ``fedmvp`` that drives ``export`` and
``edge_client`` (docs/architecture.md): the training core itself knows nothing of bundles.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import click

from fedmvp_apps.cli.common import BadInput, echo_run_table, emit_json, quiet_open_clip_logging
from fedmvp.runs import RunDir

# On-device personalisation recipe of the demo. The edge client's defaults are the paper's (SGD 0.003,
# alpha 10), under which the tiny CLIP's LoRA barely moves; AdamW, the usual LoRA optimizer, with a
# lighter consistency weight learns (docs/tutorials/demo.md; benchmarks/edge_personalise.py).
EDGE_TRAIN = {"epochs": 20, "lr": 0.01, "optimizer": "adamw", "alpha": 1.0}
EDGE_BATCH = 32
DEMO_EVAL_EVERY = 5


@dataclass
class EdgeDemoResult:
    bundle: Path
    bundle_mb: float
    parity: list[str]
    classes: list[str]
    before: float | None
    after: float | None
    train_examples: int
    train_loss: tuple[float, float]
    recipe: str = ""
    ingested_round: int | None = None
    fed_bundle: Path | None = None
    fed_accuracy: float | None = None


def new_class_folders(run: RunDir, shots: int) -> tuple[Path, Path, list[str]]:
    """(local training folder, held-out test folder) of the run's new classes, as ImageFolder trees.

    Needs only the run's federation (image paths), not a CLIP."""
    from fedmvp.data.federation import load_federation

    _, federation = load_federation(run.preset_file())
    new_sets = [ev for ev in federation.evaluations if ev.kind == "new"]
    if not new_sets:
        raise RuntimeError("the preset has no new classes to personalise on")
    ev = new_sets[0]
    local, held_out = run.path / "edge" / "local", run.path / "edge" / "held-out"
    for folder in (local, held_out):
        shutil.rmtree(folder, ignore_errors=True)
    for path, label in ev.samples:
        test_file = Path(path)
        name = ev.class_names[label]
        train_dir = test_file.parent.parent.parent / "train" / test_file.parent.name
        (held_out / name).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(test_file, held_out / name / test_file.name)
        if not (local / name).exists():
            (local / name).mkdir(parents=True)
            for src in sorted(train_dir.glob("*.png"))[:shots]:
                shutil.copyfile(src, local / name / src.name)
    return local, held_out, list(ev.class_names)


def run_edge_demo(run: RunDir, shots: int = 8) -> EdgeDemoResult:
    """Export the last round, classify held-out new-class images, personalise on them, classify again;
    then ingest the update as the run's next round, export it and classify with that bundle."""
    from edge_client.infer import infer_paths
    from edge_client.train import train_local
    from export.bundle_writer import BundleOptions, ExportOptions, export_bundle
    from fedmvp.federated.ingest import ingest

    replace = ExportOptions(BundleOptions(force=True, progress=True))
    bundle = export_bundle(run.path, out=run.path / "bundle", options=replace)
    local, held_out, classes = new_class_folders(run, shots)
    before = infer_paths([str(held_out)], bundle.path).accuracy()
    trained = train_local(str(local), bundle.path, out=str(run.path / "edge" / "updates"), batch_size=EDGE_BATCH,
                          progress=True, allow_run_dir=True, **EDGE_TRAIN)
    after = infer_paths([str(held_out)], bundle.path).accuracy()
    losses = trained.epoch_losses
    fed = ingest(run, [trained.update_path])  # the loop back: the device's update is the run's next round
    if fed.round is None:
        raise RuntimeError(f"fedmvp ingest refused the demo's update: {fed.rejected[0].reason}")
    fed_bundle = export_bundle(run.path, fed.round, run.path / f"bundle-round-{fed.round:04d}", replace)
    fed_accuracy = infer_paths([str(held_out)], fed_bundle.path).accuracy()
    return EdgeDemoResult(bundle=bundle.path, bundle_mb=bundle.total_bytes / 1e6, parity=bundle.lines()[:-1],
                          classes=classes, before=before, after=after, train_examples=trained.num_examples,
                          train_loss=(losses[0], losses[-1]),
                          recipe="{optimizer} lr {lr:g}, alpha {alpha:g}, {epochs} epochs".format(**EDGE_TRAIN),
                          ingested_round=fed.round, fed_bundle=fed_bundle.path, fed_accuracy=fed_accuracy)


@click.command()
@click.option("--rounds", type=click.IntRange(min=1), default=None, help="Override the demo preset's rounds.")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="Run directory (default: runs/demo-<timestamp>).")
@click.option("--config", default="demo", show_default=True, help="Preset to demonstrate.")
@click.option("--eval-every", type=click.IntRange(min=0), default=DEMO_EVAL_EVERY, show_default=True,
              help="Evaluate every N rounds, so accuracy.png shows tuned vs zero-shot over the rounds "
                   "(0: only the last round).")
@click.option("--edge/--no-edge", default=True, show_default=True,
              help="Also export the last round, run the edge client (infer, then LoRA training) and feed "
                   "its update back into the run (fedmvp ingest, a new round, exported).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def demo(rounds: int | None, run_dir: str | None, config: str, eval_every: int, edge: bool, as_json: bool) -> None:
    """The whole flow on the embedded world, offline: federated training on Flower, the
    paper's Local/Base/New/HM table, an ONNX bundle of the last round, and the edge
    client classifying held-out new-class images before and after on-device LoRA
    training."""
    quiet_open_clip_logging()
    from fedmvp_apps.cli.train import train_or_resume
    from fedmvp.federated.evaluation import evaluate_run
    from fedmvp.runs import RunError

    try:
        run = train_or_resume(config, rounds, run_dir, resume=False, eval_every=eval_every, device="auto",
                              command="fedmvp demo")
        result = evaluate_run(run)
    except RunError as err:
        raise click.ClickException(str(err)) from err
    except BadInput:
        raise
    edge_result = run_edge_demo(run) if edge else None
    if as_json:
        emit_json({**result, "edge": asdict(edge_result) if edge_result else None})
        return
    echo_run_table(result, run.path)
    if edge_result:
        pct = lambda v: f"{100 * v:.2f}%" if v is not None else "-"  # noqa: E731
        click.echo(f"bundle: {edge_result.bundle} ({edge_result.bundle_mb:.2f} MB)")
        for line in edge_result.parity:
            click.echo(line)
        click.echo(f"edge-client infer on held-out images of {len(edge_result.classes)} new classes: "
                   f"{pct(edge_result.before)} top-1")
        click.echo(f"edge-client train on {edge_result.train_examples} local images (LoRA only, "
                   f"{edge_result.recipe}, loss {edge_result.train_loss[0]:.3f} -> {edge_result.train_loss[1]:.3f}): "
                   f"{pct(edge_result.after)} top-1 after")
        click.echo(f"fedmvp ingest: the device's update is round {edge_result.ingested_round} of the run; "
                   f"fedmvp-export of that round ({edge_result.fed_bundle}): {pct(edge_result.before)} top-1 on "
                   f"the round the device started from, {pct(edge_result.fed_accuracy)} on the round it fed")
