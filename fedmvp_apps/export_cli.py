"""`fedmvp-export`: one round of a run -> an edge bundle. Exit codes: 0 ok, 1 parity failed, 2 bad input,
128 + the signal's number when stopped (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP: nothing written)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import click

from fedmvp_apps.deploy.stopping import NAMES, interrupt_at_signal

EXIT_OK, EXIT_PARITY, EXIT_INPUT = 0, 1, 2


def _quiet_libraries() -> None:
    """open_clip announces random init; the exporters log warnings that are not the user's business."""
    import logging
    import warnings

    for name in ("root", "torch.onnx", "torch.export", "onnxscript", "onnx_ir", "torch._dynamo"):
        logging.getLogger(None if name == "root" else name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--run", "run", type=click.Path(path_type=Path), default=None,
              help="Run directory (default: the newest under ./runs holding a config.json).")
@click.option("--round", "round_number", type=click.IntRange(min=0), default=None,
              help="Round to export (default: the run's last complete round).")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Bundle directory (default: RUN/bundles/round-NNNN-PRECISION, and ./bundle, edge-client's "
                   "default, becomes a symlink to it unless ./bundle is a directory or file of your own).")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "int8"]), default="fp32", show_default=True,
              help="Precision of the ONNX model (fp32 parity is always checked).")
@click.option("--max-accuracy-drop", type=click.FloatRange(min=0), default=None, metavar="POINTS",
              help="With --precision int8: keep in fp32 the fewest layers that hold the top-1 accuracy on the "
                   "run's labelled test images (or --images DIR/<class>/) within this many points of fp32's "
                   "[default: 1.0]. Without 32 labelled images: top-1 agreement with fp32 >= 99%, with a warning.")
@click.option("--int8-scheme", type=click.Choice(["auto", "dynamic", "static"]), default=None,
              help="With --precision int8: dynamic (activations quantised per call) or static (QDQ, activation "
                   "ranges calibrated on the run's training images), each keeping fp32 the fewest layers that "
                   "hold the bound; auto plans both and ships the faster at batch 8 on this machine (dynamic, "
                   "with a warning, when no real image can calibrate static) [default: auto].")
@click.option("--attributes", type=click.Path(path_type=Path), default=None,
              help="{class: [phrases]} JSON: bake this class set instead of the run's (untrained classes too).")
@click.option("--domain", default=None, help="With --attributes: sentence prefix of this domain (e.g. sketch).")
@click.option("--parity-images", type=click.IntRange(min=32), default=256, show_default=True,
              help="Up to this many test images of the run (or of --images) are compared between ONNX Runtime "
                   "and PyTorch (noise images only fill up to 32); int8 calibrates on as many training images.")
@click.option("--images", "images", type=click.Path(path_type=Path), default=None,
              help="Folder of images (walked recursively) that the parity check judges on, and int8 calibrates "
                   "on when the run's training images are not reachable. Default: the run's test images where "
                   "this machine holds them, else generated pixels (with a warning).")
@click.option("--check-images/--no-check-images", "ship_images", default=True, show_default=True,
              help="Ship the first 32 parity images (the run's test images, or --images) in the bundle as "
                   "check_images.safetensors: edge-client --runtime auto verifies runtimes on them. They are this "
                   "machine's pictures and travel to every device: --no-check-images ships generated colour "
                   "fields instead (docs/howto/check-images.md).")
@click.option("--inference-only", is_flag=True,
              help="Leave out what only on-device training needs: the training program, and for fp16/int8 "
                   "the fp32 frozen weights (the ONNX model then holds its own). `edge-client train` refuses it.")
@click.option("--format", "formats", type=click.Choice(["onnx", "torchscript", "executorch"]), multiple=True,
              help="Model formats the bundle carries (repeatable): onnx always; torchscript adds "
                   "model.torchscript.pt, the same inference module traced with torch.jit (LoRA as inputs), held "
                   "to the fp32 parity rules like ONNX (edge-client --runtime torchscript runs it); executorch adds "
                   "model.pte, the module lowered to ExecuTorch (XNNPACK) for phones, parity-checked the same way "
                   "(needs the [executorch] extra; docs/howto/executorch.md).")
@click.option("--force", is_flag=True, help="Replace an existing bundle directory (after the new one is complete).")
@click.option("--discard-device-state", is_flag=True,
              help="With --force: replace the directory even if it holds a device's personalised/ LoRAs or "
                   "previous/ bundle (refused otherwise: they would be lost).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def main(run: Path | None, round_number: int | None, out: Path | None, precision: str,
         max_accuracy_drop: float | None, int8_scheme: str | None, attributes: Path | None,
         domain: str | None, parity_images: int, images: Path | None, ship_images: bool, inference_only: bool,
         formats: tuple[str, ...], force: bool, discard_device_state: bool, as_json: bool) -> None:
    """Compile a round of a fedmvp run into an edge bundle.

    The bundle holds one ONNX model (frozen CLIP + PromptFormer + the attribute text features
    as constants, LoRA as named initializers), a torch.export training program whose only
    trainable inputs are the LoRA tensors, the LoRA tensors, the frozen weights (shared by
    both) and a manifest with sha256 hashes and the ONNX Runtime vs PyTorch parity check.

    Exit codes: 0 written, 1 parity failed (nothing written), 2 bad input, 130/143/129 stopped by
    Ctrl-C/SIGTERM/SIGHUP (nothing written; an export killed outright leaves OUT.tmp-PID-*, which
    the next export of OUT removes).
    """
    _quiet_libraries()
    if "executorch" in formats and importlib.util.find_spec("executorch") is None:  # before minutes of export
        _fail(as_json, EXIT_INPUT, "--format executorch needs executorch: pip install 'fedmvp[executorch]' "
                                   "(docs/howto/executorch.md)")
    from export.bundle_writer import BundleOptions, ExportOptions, ParityError, export_bundle, point_default_bundle
    from export.errors import ExportError

    write = BundleOptions(precision=precision, force=force, discard_device_state=discard_device_state,
                          training=not inference_only, ship_images=ship_images, max_accuracy_drop=max_accuracy_drop,
                          int8_scheme=int8_scheme, progress=not as_json, torchscript="torchscript" in formats,
                          executorch="executorch" in formats)
    options = ExportOptions(write, images=images, parity_images=parity_images, attributes=attributes, domain=domain)
    try:
        with interrupt_at_signal() as heard:  # Ctrl-C, SIGTERM, SIGHUP: the staging folder goes, OUT stays
            result = export_bundle(run, round_number, out, options)
    except KeyboardInterrupt:
        _fail(as_json, 128 + heard["signum"], f"stopped by {NAMES.get(heard['signum'], 'a signal')}: nothing was "
                                              f"written (an existing bundle directory is as it was)")
    except ParityError as err:
        _fail(as_json, EXIT_PARITY, f"parity failed, no bundle written: {err}",
              {"parity": {k: r.to_manifest() for k, r in err.results.items()}})
    except (ExportError, OSError) as err:
        _fail(as_json, EXIT_INPUT, " ".join(str(err).split()))
    linked = point_default_bundle(result.path) if out is None else None  # the default: ./bundle follows
    if as_json:
        click.echo(json.dumps({"ok": True, "bundle": str(result.path), "default_bundle": linked,
                               "precision": precision,
                               "round": result.manifest["source"].get("round"),
                               "parity": {k: r.to_manifest() for k, r in result.parity.items()},
                               "sizes": result.sizes, "total_bytes": result.total_bytes,
                               "int8": result.int8.to_manifest() if result.int8 else None,
                               "check_images": result.manifest.get("check_images"),
                               "discarded": result.discarded}, sort_keys=True))
    else:
        for line in result.lines() + ([linked] if linked else []):
            click.echo(line)
    if not result.passed:
        held = result.int8.accuracy if result.int8 else None
        click.echo(f"warning: {precision} parity below the target (bundle kept; fp32 parity passed" +
                   (f"; the accuracy bound held: {held['drop_points']:.2f} of {held['max_drop_points']:g} points"
                    if held else "") + ")", err=True)


def _fail(as_json: bool, code: int, message: str, extra: dict | None = None) -> None:
    if as_json:
        click.echo(json.dumps({"ok": False, "error": message, **(extra or {})}, sort_keys=True))
    else:
        click.echo(f"error: {message}", err=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
