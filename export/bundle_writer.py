"""Write an edge bundle: the export core (explicit arguments) and the run-reading entry point.

``write_bundle`` needs only a model with its round loaded, a class set and parity images
(``BundleInputs``; how to write: ``BundleOptions``; the steps: ``export.bundle_steps``);
``export_bundle`` finds those in a run directory (what ``fedmvp-export`` and ``fedmvp demo``
call). Everything is written into ``OUT.tmp-<pid>-xxxx`` and renamed to ``OUT`` once complete and
verified (one a killed export left is removed by the next: ``export.staging``); with ``force`` an existing ``OUT`` is replaced only then, and only if it is a bundle
(or empty) without device state (``discard_device_state`` allows that too) that no device command
is changing (``export.publish``). Nothing in the files
depends on time or on the output path, so the same round exported twice is byte-identical.
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from fedmvp_formats.atomic import move
from fedmvp_formats.bundle_manifest import MANIFEST, PRECISIONS
from fedmvp_formats.files import sha256_file

from export import check_images, parity
from export.bundle_steps import BundleInputs, BundleOptions, BundleWrite, ParityError
from export.class_set import ClassSet, file_class_set, run_class_set
from export.errors import ExportError
from export.int8 import Int8Plan
from export.int8_scheme import int8_scheme_for
from export.publish import check_out, publish
from export.staging import clean_stale_staging, staging_dir
from export.run_inputs import export_images, find_run, images_folder, load_checkpoint, read_config, rebuild_model
from fedmvp.clip import LoadedClip
from fedmvp.federated.privacy_budget import round_privacy
from fedmvp.model import FedMVP
from fedmvp.runs import RunError, warn

__all__ = ["DEFAULT_PARITY_IMAGES", "BundleInputs", "BundleOptions", "BundleResult", "ExportOptions", "ParityError",
           "default_out", "export_bundle", "point_default_bundle", "write_bundle"]

# 256: with 64 images "99% top-1 agreement" means all of them, and one near-tie decides; 256 lets the
# fp16/int8 criterion mean what it says. The same count of training images calibrates int8.
DEFAULT_PARITY_IMAGES = 256


@dataclass
class BundleResult:
    """Where the bundle is, its manifest, parity per precision and file sizes in bytes."""

    path: Path
    manifest: dict[str, Any]
    parity: dict[str, parity.ParityResult]
    sizes: dict[str, int] = field(default_factory=dict)
    int8: Int8Plan | None = None
    discarded: list[str] = field(default_factory=list)  # device state deleted with the replaced bundle
    check: check_images.ShippedCheck | None = None  # the check images it carries (export/check_images.py)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.parity.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes.values())

    def lines(self) -> list[str]:
        out = [r.line() for r in self.parity.values()] + ([self.int8.line()] if self.int8 else []) \
            + ([self.check.line()] if self.check else [])
        width = max((len(name) for name in self.sizes), default=0)
        out += [f"  {name:<{width}} {size / 1e6:8.3f} MB" for name, size in sorted(self.sizes.items())]
        out.append(f"bundle: {self.path} ({self.total_bytes / 1e6:.3f} MB, {self.manifest['precision']})")
        if self.discarded:
            out.append(f"discarded device state of the replaced bundle: {', '.join(self.discarded)}")
        return out


def write_bundle(model: FedMVP, clip: LoadedClip, classes: ClassSet, out: str | Path, inputs: BundleInputs,
                 options: BundleOptions = BundleOptions()) -> BundleResult:
    """Export ``model`` (round tensors loaded) over ``classes`` into the bundle directory ``out``.

    With at least ``parity.MIN_IMAGES`` labelled images, int8 keeps the fewest layers fp32 that hold the
    top-1 accuracy on those within ``options.max_accuracy_drop`` points (export/int8.py), else those
    that agree with fp32 on the calibration images. Written into ``OUT.tmp-xxxx``, verified, then
    published (``export.publish``)."""
    out, precision = Path(out), options.precision
    if precision not in PRECISIONS:
        raise ExportError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    check_out(out, options.force, options.discard_device_state)
    classes.validate()
    if len(inputs.images) < parity.MIN_IMAGES:
        raise ExportError(f"parity needs at least {parity.MIN_IMAGES} images, got {len(inputs.images)}")
    steps = ["text features", "onnx", "parity fp32"] + ([f"{precision}"] if precision != "fp32" else []) \
        + (["torchscript"] if options.torchscript else []) + (["executorch"] if options.executorch else []) \
        + (["training artifact"] if options.training else []) \
        + (["torchscript training"] if options.torchscript and options.training else []) + ["manifest"]
    bar = tqdm(total=len(steps), desc="export", unit="step", disable=not options.progress, file=sys.stderr,
               leave=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    for line in clean_stale_staging(out):  # what an export killed outright left (export.staging)
        warn(line)
    tmp = staging_dir(out)
    writing = BundleWrite(tmp, model, clip, classes, inputs, options, bar)
    try:
        manifest = writing.run()
        discarded = publish(tmp, out, options.force, options.discard_device_state)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    sizes = {e: out.joinpath(e).stat().st_size for e in [*writing.names.values(), MANIFEST]}
    return BundleResult(path=out, manifest=manifest, parity=writing.results, sizes=sizes, int8=writing.int8_plan,
                        discarded=discarded, check=writing.check)


# ---- the run-reading layer ------------------------------------------------------------------------
def round_base_digest(tensors: dict[str, Any]) -> str:
    """The round's base digest (``fedmvp_formats.promptformer.base_digest``: its PromptFormer and global LoRA):
    what a device's update trained on this bundle names as its base, and `fedmvp ingest` finds the round by."""
    from fedmvp_formats.promptformer import state_base_digest

    return state_base_digest({k: v.detach().cpu().float().numpy() for k, v in tensors.items()})


def point_default_bundle(path: Path, cwd: Path | None = None) -> str:
    """Point ``./bundle`` (edge-client's default bundle) at ``path`` with a relative symlink; one line saying so.

    Why: `fedmvp-export --round N` then `edge-client infer img.jpg` in the same directory must just work.
    Only a missing ``./bundle`` or a symlink is replaced (atomically: a new link renamed over it); a real
    directory or file of that name is never touched, and the line says what to type instead."""
    from edge_client.bundle import DEFAULT_BUNDLE

    cwd = Path(cwd) if cwd is not None else Path.cwd()
    link = cwd / DEFAULT_BUNDLE
    if (link.exists() or link.is_symlink()) and not link.is_symlink():
        kind = "directory" if link.is_dir() else "file"
        return (f"./{DEFAULT_BUNDLE} is a {kind} of your own, left as it is: use edge-client --bundle {path} "
                f"(or export FEDMVP_BUNDLE={path})")
    target = os.path.relpath(Path(path).resolve(), cwd.resolve())
    temp = cwd / f".{DEFAULT_BUNDLE}.{os.getpid()}.{uuid.uuid4().hex[:8]}.link"
    try:
        os.symlink(target, temp, target_is_directory=True)
        move(temp, link)
    except OSError as err:
        temp.unlink(missing_ok=True)
        return f"./{DEFAULT_BUNDLE} not pointed at the bundle ({err.strerror or err}): use edge-client --bundle {path}"
    return f"./{DEFAULT_BUNDLE} -> {target} (edge-client's default bundle)"


def default_out(run_path: Path, round_number: int, precision: str) -> Path:
    return run_path / "bundles" / f"round-{round_number:04d}-{precision}"


@dataclass(frozen=True)
class ExportOptions:
    """How ``export_bundle`` finds its inputs in a run, and how it writes the bundle (``bundle``)."""

    bundle: BundleOptions = BundleOptions()
    # parity images: a folder (walked recursively); None: the run's test images where reachable, else
    # generated pixels with one warning line (``export.run_inputs.export_images``)
    images: str | Path | None = None
    parity_images: int = DEFAULT_PARITY_IMAGES  # how many parity images (at least ``parity.MIN_IMAGES``)
    attributes: str | Path | None = None  # a class set of this attribute file instead of the run's record
    domain: str | None = None  # with ``attributes``: the domain of a {domain} attribute file
    runs_root: str | Path = "runs"  # where the newest run is looked for when no run is named


def export_bundle(run: str | Path | None = None, round_number: int | None = None, out: str | Path | None = None,
                  options: ExportOptions = ExportOptions()) -> BundleResult:
    """Export round ``round_number`` (default: the last complete one) of ``run`` (default: the newest).

    Needs the run directory only: the class set is the run's record; parity runs on ``options.images``
    when given, else on the run's test images where reachable, else on generated pixels. int8's
    ``max_accuracy_drop`` (default 1.0 points) and ``int8_scheme`` (default auto; without real calibration
    images auto is dynamic) are refused for another precision."""
    write = options.bundle
    precision, max_accuracy_drop, int8_scheme = write.precision, write.max_accuracy_drop, write.int8_scheme
    if precision not in PRECISIONS:
        raise ExportError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    if max_accuracy_drop is not None and precision != "int8":
        raise ExportError(f"--max-accuracy-drop applies to --precision int8, not {precision}")
    if max_accuracy_drop is not None and not max_accuracy_drop >= 0:
        raise ExportError(f"--max-accuracy-drop must be 0 or more points, got {max_accuracy_drop}")
    if int8_scheme is not None and precision != "int8":
        raise ExportError(f"--int8-scheme applies to --precision int8, not {precision}")
    if options.parity_images < parity.MIN_IMAGES:
        raise ExportError(f"--parity-images must be at least {parity.MIN_IMAGES}")
    attributes, domain, parity_images = options.attributes, options.domain, options.parity_images
    run_dir = find_run(run, Path(options.runs_root))
    config = read_config(run_dir)
    checkpoint = load_checkpoint(run_dir, round_number)
    try:  # [privacy]: what the round has spent, read before anything is built or written
        privacy = round_privacy(run_dir, checkpoint.round)
    except RunError as err:
        raise ExportError(str(err)) from None
    target = Path(out) if out is not None else default_out(run_dir.path, checkpoint.round, precision)
    check_out(target, write.force, write.discard_device_state)
    folder = images_folder(options.images)
    # the class set: the given file's, else the run's record (docs/architecture.md, Records that travel)
    classes = file_class_set(Path(attributes), domain) if attributes else run_class_set(run_dir)
    model = rebuild_model(run_dir, checkpoint)  # FedMVP.from_run: the run's seed, CLIP, method record, weights
    clip = model.clip_info
    ckpt_path = run_dir.round_weights_path(checkpoint.round)
    chosen = export_images(run_dir, clip.preprocess, clip.image_size, parity_images,
                           folder, int8=precision == "int8", class_names=list(classes.names))
    scheme_why = int8_scheme_for(int8_scheme or "auto", chosen.calibration_real)[1]  # the same call decides
    for line in (chosen.warning, chosen.unlabelled, scheme_why if precision == "int8" else None):
        if line:
            warn(line)
    source = {"run": run_dir.path.name, "run_path": str(run_dir.path.resolve()), "run_id": config.get("run_id"),
              "round": checkpoint.round, "base_digest": round_base_digest(checkpoint.tensors),
              "checkpoint_sha256": sha256_file(ckpt_path), "lora_clients": checkpoint.state.get("lora_clients")}
    inputs = BundleInputs(chosen.parity, labels=chosen.labels, calibration=chosen.calibration,
                          real_calibration=chosen.calibration_real, image_note=chosen.note, source=source,
                          privacy=privacy)
    return write_bundle(model, clip, classes, target, inputs, write)
