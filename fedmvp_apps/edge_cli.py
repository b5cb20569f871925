"""`edge-client` command line: infer, train, rollback, info, join (fedmvp_apps/edge_join.py).

Exit codes: 0 ok; 1 some files failed (infer), training failed, nothing to roll back;
2 bad input (unreadable or tampered bundle, unknown class, unavailable provider, bad
options), or the bundle is locked by another command (`train`, `rollback`: one line naming it;
--wait waits instead; a lock of another host is taken over only with --break-lock), or its .lock is a
link (docs/security.md); 130 interrupted. `infer` and `rollback` never import torch; `train` imports it
when it starts training, `info` only to report on it. `train`'s defaults and most of its
help come from `TrainOptions`, the one place they are defined.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import click

from edge_client.engines import DEFAULT_RUNTIME
from edge_client.train_options import DEVICES, OPTIMIZERS, PROGRAMS, TrainOptions
from fedmvp_apps.edge_bundle import BUNDLE_HELP, BundleDir, bundle_option_callback, switch_off_runtimes
from fedmvp_apps.edge_join import runtime_options

EXIT_OK, EXIT_FAILED, EXIT_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
_WAIT_HELP = ("When another command holds the bundle's lock (BUNDLE/.lock: a train, a refresh, a rollback), "
              "wait for it to finish instead of exiting 2.")
_BREAK_HELP = ("Take over the bundle's lock (BUNDLE/.lock) when its record names a process on ANOTHER host that "
               "you know is gone (a bundle on a shared file system: flock cannot see other hosts' processes). "
               "Without it such a lock is refused (exit 2, one line naming host, pid and since).")


def _bundle_option(f: Any) -> Any:
    return click.option("--bundle", "bundle", type=click.Path(path_type=Path, file_okay=False), default=None,
                        callback=bundle_option_callback, help=BUNDLE_HELP)(f)


def _json_option(f: Any) -> Any:
    return click.option("--json", "as_json", is_flag=True, help="Machine-readable output (JSON).")(f)


def _provider_options(f: Any) -> Any:
    """ONNX Runtime's --provider, and --threads (every runtime's)."""
    f = click.option("--threads", type=click.IntRange(min=1), default=None,
                     help="CPU threads for the runtime (default: the cores this process may use).")(f)
    return click.option("--provider", type=click.Choice(["auto", "cpu", "cuda", "tensorrt"], case_sensitive=False),
                        default="auto", show_default=True,
                        help="ONNX Runtime's execution provider; auto takes TensorRT, then CUDA, then CPU. A named "
                             "one that cannot load is an error.")(f)


def _wait_option(f: Any) -> Any:
    """--wait, and --break-lock (both about the bundle's lock)."""
    f = click.option("--break-lock", is_flag=True, help=_BREAK_HELP)(f)
    return click.option("--wait", is_flag=True, help=_WAIT_HELP)(f)


def _patience(wait: bool) -> float:
    """Seconds to wait for the bundle's lock: as long as it takes with --wait, else none."""
    return math.inf if wait else 0.0


def _fail(as_json: bool, code: int, message: str, **extra: Any) -> None:
    from edge_client.images import printable

    message = printable(" ".join(str(message).split()))
    if as_json:
        click.echo(json.dumps({"ok": False, "error": message, **extra}, sort_keys=True))
    else:
        click.echo(f"error: {message}", err=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Run a fedmvp bundle on this device and improve it with local data.

    `infer` classifies images with ONNX Runtime (no torch needed); `train` updates
    only the LoRA tensors on local labelled images and writes an update file that
    the federation's server can aggregate; `rollback` undoes the last personalisation
    (`--refresh`: the last bundle refresh); `info` describes the bundle and this device; `join`
    makes this device a node of the federation, training the global LoRA each round it is asked.
    """
    switch_off_runtimes()


# ---- infer ---------------------------------------------------------------------------------------------
@main.command()
@click.argument("paths", nargs=-1, required=True)
@_bundle_option
@click.option("--top-k", type=click.IntRange(min=1), default=5, show_default=True, help="Classes shown per image.")
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True,
              help="Images per ONNX Runtime call.")
@_provider_options
@runtime_options
@click.option("--max-pixels", type=click.IntRange(min=1), default=None,
              help="Refuse images with more pixels (decompression bombs; default 100,000,000).")
@click.option("--bundle-lora", is_flag=True, help="Run the bundle's exported LoRA, not this device's personalised one.")
@_json_option
def infer(paths: tuple[str, ...], bundle: BundleDir, top_k: int, batch_size: int, provider: str,
          threads: int | None, runtime: str, precision: str, max_pixels: int | None, bundle_lora: bool,
          as_json: bool) -> None:
    """Classify images: PATHS are files, directories (recursive) and glob patterns.

    Prints a table (or with --json one JSON line per file: path, top_k classes with
    probabilities, latency_ms). A file that cannot be read gets a one-line error and
    the others are still classified; the exit code is then 1.
    """
    from edge_client.bundle import BundleError
    from edge_client.images import DEFAULT_MAX_PIXELS, printable
    from edge_client.infer import FileFailure, Prediction, Predictor
    from edge_client.runtime import ProviderError
    from fedmvp_apps.edge_cli_output import print_table

    try:
        predictor = Predictor(bundle, provider=provider.lower(), threads=threads, personalised=not bundle_lora,
                              runtime=runtime.lower(), precision=precision.lower())
    except (BundleError, ProviderError, ImportError) as err:
        _fail(as_json, EXIT_INPUT, str(err))
    except Exception as err:  # noqa: BLE001 - the runtime's own load errors (e.g. a model it cannot parse)
        _fail(as_json, EXIT_INPUT, f"cannot load the model: {err}")
    click.echo(predictor.choice.line, err=True)
    if not as_json:
        loaded = predictor.bundle
        shown = printable(str(loaded.path))
        click.echo(f"provider: {predictor.provider}  ·  bundle: {shown} (round {loaded.round}, "
                   f"{loaded.precision})  ·  LoRA: {predictor.lora.describe()}", err=True)

    def stream(item: Prediction | FileFailure) -> None:
        if as_json:
            engine = predictor.engine
            click.echo(json.dumps({**item.to_json(), "provider": predictor.provider, "runtime": engine.runtime,
                                   "precision": engine.precision}, ensure_ascii=False))
        elif isinstance(item, FileFailure):
            click.echo(f"error: {printable(item.error)}", err=True)

    result = predictor.infer(list(paths), top_k=top_k, batch_size=batch_size,
                             max_pixels=max_pixels or DEFAULT_MAX_PIXELS,
                             progress=not as_json and sys.stderr.isatty(), on_result=stream)
    if not as_json:
        print_table(result.predictions)
    s = result.summary()
    rate = f", {s['images_per_second']:.1f} images/s" if s["images_per_second"] else ""
    click.echo(f"{s['images']} classified, {s['failed']} failed in {s['seconds']:.2f} s{rate}", err=True)
    sys.exit(EXIT_FAILED if result.errors else EXIT_OK)


# ---- train ---------------------------------------------------------------------------------------------
class _BatchSize(click.ParamType):
    name = "auto|N"

    def convert(self, value: Any, param: Any, ctx: Any) -> int | str:
        if isinstance(value, int) or str(value).lower() == "auto":
            return value if isinstance(value, int) else "auto"
        try:
            number = int(value)
        except ValueError:
            self.fail(f"{value!r} is not 'auto' or a positive integer", param, ctx)
        if number < 1:
            self.fail(f"{value!r} is not 'auto' or a positive integer", param, ctx)
        return number


def _train_option(*decls: str, name: str, **kwargs: Any) -> Any:
    """A click option whose default and help are `TrainOptions` field ``name``'s."""
    kwargs.setdefault("help", TrainOptions.help(name))
    default = TrainOptions.default(name)
    return click.option(*decls, default=default, show_default=default is not None, **kwargs)


@main.command()
@click.option("--data", type=click.Path(path_type=Path), required=True,
              help="ImageFolder tree of local labelled images: DATA/<class>/<image>; classes must be the bundle's.")
@_bundle_option
@_train_option("--epochs", name="epochs", type=click.IntRange(min=1))
@_train_option("--batch-size", name="batch_size", type=_BatchSize(),
               help="Images per step; auto: on CUDA the largest under --max-memory-gb, on CPU 32.")
@_train_option("--max-memory-gb", name="max_memory_gb", type=click.FloatRange(min=0, min_open=True),
               help="GPU memory (GiB) --batch-size auto may use (default: 90% of what is free).")
@_train_option("--out", name="out", type=click.Path(path_type=Path))
@_train_option("--lr", name="lr", type=click.FloatRange(min=0, min_open=True),
               help=f"Learning rate (SGD: momentum {TrainOptions.default('momentum')}; both optimizers: "
                    f"weight decay {TrainOptions.default('weight_decay')}).")
@_train_option("--optimizer", name="optimizer", type=click.Choice(OPTIMIZERS, case_sensitive=False))
@_train_option("--alpha", name="alpha", type=click.FloatRange(min=0))
@_train_option("--device", name="device", type=click.Choice(DEVICES, case_sensitive=False))
@_train_option("--seed", name="seed", type=int)
@click.option("--from-bundle", is_flag=True,
              help="Start from the bundle's exported LoRA instead of this device's active (personalised) one.")
@click.option("--no-apply", is_flag=True, help="Only write the update file; keep the device's active LoRA.")
@_train_option("--threads", name="threads", type=click.IntRange(min=1))
@_train_option("--program", name="program", type=click.Choice(PROGRAMS, case_sensitive=False))
@_wait_option
@_json_option
def train(data: Path, bundle: BundleDir, epochs: int, batch_size: int | str, max_memory_gb: float | None,
          out: Path, lr: float, optimizer: str, alpha: float | None, device: str, seed: int, from_bundle: bool,
          no_apply: bool, threads: int | None, program: str, wait: bool, break_lock: bool, as_json: bool) -> None:
    """Train only the LoRA tensors on local labelled images (needs torch: fedmvp[edge-train]).

    Loss: cross-entropy over the bundle's classes + alpha * (1 - cos(prompted, frozen CLIP
    feature of a flipped view)). Writes an update file (safetensors: the LoRA tensors and
    metadata: bundle id and round, number of examples, mean loss, time), then makes the
    new LoRA the device's own for `infer` (the previous one is kept: `edge-client rollback`).
    Nothing is written until training has finished: an interrupted run changes nothing.
    One command at a time changes a bundle: while another holds it, train exits 2 naming it
    (pid, host, since), or with --wait starts from what that one left.
    """
    from edge_client.bundle import BundleError
    from edge_client.train import train_local
    from edge_client.train_options import TrainingError, TrainInputError
    from edge_client.update import UpdateError

    _refuse_unrunnable_training(bundle, as_json)
    try:
        options = TrainOptions(epochs=epochs, batch_size=batch_size, max_memory_gb=max_memory_gb, out=out, lr=lr,
                               optimizer=optimizer.lower(), alpha=alpha, device=device.lower(), seed=seed,
                               apply=not no_apply, start="bundle" if from_bundle else "active", threads=threads,
                               program=program.lower())
        result = train_local(data, bundle, options, progress=not as_json, wait=_patience(wait),
                             break_lock=break_lock)
    except KeyboardInterrupt:
        _fail(as_json, EXIT_INTERRUPTED, "interrupted: nothing was written, the bundle is unchanged")
    except (TrainInputError, BundleError, UpdateError) as err:
        _fail(as_json, EXIT_INPUT, str(err))
    except TrainingError as err:
        _fail(as_json, EXIT_FAILED, str(err))
    if as_json:
        click.echo(json.dumps(result.to_json(), sort_keys=True, ensure_ascii=False))
        return
    for line in result.skipped:
        click.echo(f"skipped: {line}", err=True)
    losses = result.epoch_losses
    classes, epochs = len(result.classes), result.epochs
    click.echo(f"trained the LoRA on {result.num_examples} images of {classes} class{'es' if classes != 1 else ''}, "
               f"{epochs} epoch{'s' if epochs != 1 else ''}, batch {result.batch_size}, {result.optimizer} "
               f"lr {result.lr:g}, {result.device}"
               + (f" ({result.autocast} autocast)" if result.autocast else "")
               + (", through train.torchscript.pt" if result.program == "torchscript" else "")
               + f", {result.seconds:.1f} s")
    trend = f"{losses[0]:.4f} (epoch 1) -> {losses[-1]:.4f} (epoch {len(losses)})" if len(losses) > 1 \
        else f"{losses[0]:.4f}"
    click.echo(f"loss: {trend}, mean {result.mean_loss:.4f}")
    click.echo(f"update: {result.update_path}")
    if result.personalised is not None:
        click.echo(f"personalised: `edge-client infer` now runs {result.personalised.file} "
                   f"(undo: edge-client rollback)")


def _refuse_unrunnable_training(bundle: BundleDir, as_json: bool) -> None:
    """Exit 2 in one line, before torch loads anything, when this device's torch cannot read the bundle's
    training program (its recorded requirement; docs/howto/jetson.md) and no TorchScript training module it
    can read stands in for it."""
    from edge_client.bundle import Bundle, BundleError, read_bundle
    from edge_client.requirements import artifact_blockers

    try:
        loaded = read_bundle(Bundle.resolve_dir(bundle), verify=False)
    except BundleError:
        return  # train's own checks say what is wrong with it
    blocked = artifact_blockers(loaded)
    alternative = "torchscript_training" in loaded.manifest["files_by_role"] and "torchscript_training" not in blocked
    if "training" in blocked and not alternative:
        _fail(as_json, EXIT_INPUT, f"cannot train on this device: {blocked['training']}")


# ---- rollback -----------------------------------------------------------------------------------------
@main.command()
@_bundle_option
@click.option("--all", "to_bundle", is_flag=True,
              help="Discard every personalisation and return to the bundle's exported LoRA.")
@click.option("--refresh", "refresh", is_flag=True,
              help="Undo the last bundle refresh: the previous round's files and the personalisation trained "
                   "on them come back (kept in BUNDLE/previous/).")
@_wait_option
@_json_option
def rollback(bundle: BundleDir, to_bundle: bool, refresh: bool, wait: bool, break_lock: bool,
             as_json: bool) -> None:
    """Undo the last `edge-client train` personalisation: infer runs the previous LoRA again."""
    from edge_client.bundle import Bundle, BundleError
    from edge_client.bundle_lock import bundle_lock
    from edge_client.lora_store import NothingToRollBack
    from edge_client.lora_store import rollback as do_rollback

    if refresh:
        if to_bundle:
            _fail(as_json, EXIT_INPUT, "--refresh and --all cannot be combined")
        _rollback_refresh(Bundle.resolve_dir(bundle), as_json, _patience(wait), break_lock)
        return
    try:
        with bundle_lock(Bundle.resolve_dir(bundle), _patience(wait), break_lock=break_lock):
            verified = Bundle.open(bundle, verify=True)
            active = do_rollback(verified, to_bundle=to_bundle)
    except NothingToRollBack as err:
        _fail(as_json, EXIT_FAILED, str(err))
    except BundleError as err:
        _fail(as_json, EXIT_INPUT, str(err))
    except OSError as err:  # a read-only bundle, a full disk: state.json is unchanged (atomic writes)
        _fail(as_json, EXIT_FAILED, f"{err.filename or Bundle.resolve_dir(bundle)}: cannot roll back "
                                    f"({err.strerror or err}); nothing was changed")
    if as_json:
        click.echo(json.dumps({"ok": True, "active": active.to_json()}, sort_keys=True))
    else:
        click.echo(f"rolled back: {verified.path} now runs the {active.describe()}")


def _rollback_refresh(path: Path, as_json: bool, wait: float, break_lock: bool) -> None:
    """`rollback --refresh`: the bundle as it was before its last refresh."""
    from edge_client.bundle import BundleError
    from edge_client.refresh import NoPreviousBundle, restore_previous

    try:
        restored = restore_previous(path, wait, break_lock)
    except NoPreviousBundle as err:
        _fail(as_json, EXIT_FAILED, str(err))
    except BundleError as err:
        _fail(as_json, EXIT_INPUT, str(err))
    if as_json:
        click.echo(json.dumps({"ok": True, "bundle": str(restored.path), "bundle_id": restored.id,
                               "round": restored.round, "promptformer_digest": restored.promptformer_digest},
                              sort_keys=True))
    else:
        click.echo(f"rolled back the refresh: {restored.path} is round {restored.round} again "
                   f"(bundle {restored.id[:12]})")


# ---- info ---------------------------------------------------------------------------------------------
@main.command()
@_bundle_option
@_provider_options
@runtime_options
@_json_option
def info(bundle: BundleDir, provider: str, threads: int | None, runtime: str, precision: str,
         as_json: bool) -> None:
    """Describe the bundle (round, classes, precision, hashes), this device (runtimes, torch, memory) and what
    would run the bundle (--runtime/--precision; auto verifies, or reads its cached verdict)."""
    from edge_client.device import describe
    from edge_client.requirements import bundle_requirements
    from fedmvp_apps.edge_cli_output import info_lines

    report = describe(bundle, runtime=runtime.lower(), precision=precision.lower(), provider=provider.lower(),
                      threads=threads)
    report["requires"] = bundle_requirements(bundle)  # which files this device's versions can run
    if as_json:
        click.echo(json.dumps(report, sort_keys=True, ensure_ascii=False))
    else:
        for line in info_lines(report):
            click.echo(line)
    asked = runtime.lower() != DEFAULT_RUNTIME or precision.lower() != "auto"  # a runtime named and missing: exit 2
    failed = not report["bundle"].get("hashes_ok") or (asked and report["runtime"].get("error"))
    sys.exit(EXIT_INPUT if failed else EXIT_OK)


if __name__ == "__main__":  # pragma: no cover
    main()


def _register_join() -> None:
    """`edge-client join` lives in its own module (it needs flwr only when it runs)."""
    from fedmvp_apps.edge_join import join

    main.add_command(join)


_register_join()
