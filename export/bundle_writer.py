"""Write an edge bundle: the export core (explicit arguments) and the run-reading entry point.

``write_bundle`` needs only a model with its round loaded, a class set and parity images;
``export_bundle`` finds those in a run directory (what ``fedmvp-export`` and ``fedmvp demo``
call). Everything is written into ``OUT.tmp-xxxx`` and renamed to ``OUT`` once complete and
verified; with ``force`` an existing ``OUT`` is replaced only then, and only if it is a bundle
(or empty) without device state (``discard_device_state`` allows that too) that no device command
is changing (``export.publish``). Nothing in the files
depends on time or on the output path, so the same round exported twice is byte-identical.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from fedmvp_formats.atomic import move
from fedmvp_formats.bundle_manifest import (CHECK_SECTION, CONTEXT_SOURCES, FORMAT, FORMAT_VERSION, MANIFEST,
                                            PRECISIONS, REFRESH_DERIVE, ROLES, TEXT_CONSTANTS, TEXT_FEATURES,
                                            file_entries, write_manifest)
from fedmvp_formats.class_set import class_set_digest
from fedmvp_formats.files import sha256_file
from fedmvp_formats.privacy import RECORD as PRIVACY
from fedmvp_formats.promptformer import promptformer_digest

from edge_client.bundle import read_bundle, verify_program_archive
from edge_client.check_images import write_check_images
from export import check_images, onnx_export, parity, training_artifact
from export.class_set import ClassSet, file_class_set, run_class_set, text_features
from export.edge_module import EdgeClassifier, build_edge_classifier, lora_scaling, query_copy_map
from export.errors import ExportError
from export.int8 import DEFAULT_MAX_ACCURACY_DROP, AccuracyTarget, Int8Plan
from export.int8_scheme import int8_scheme_for
from export.publish import check_out, publish
from export.run_inputs import export_images, find_run, images_folder, load_checkpoint, preprocess_spec, read_config, rebuild_model
from fedmvp.clip import LoadedClip
from fedmvp.federated.privacy_budget import round_privacy
from fedmvp.model import FedMVP
from fedmvp.runs import RunError, warn

# 256: with 64 images "99% top-1 agreement" means all of them, and one near-tie decides; 256 lets the
# fp16/int8 criterion mean what it says. The same count of training images calibrates int8.
DEFAULT_PARITY_IMAGES = 256
NUMERICS = {"fp32": "fp32 weights and compute",
            "fp16": "fp16 weights and compute; pixel_values, outputs and LoRA initializers fp32",
            "int8": "int8 of the MatMul weights (onnx.int8.scheme)"}  # the plan says how: Int8Plan.numerics


class ParityError(RuntimeError):
    """fp32 ONNX Runtime output differs from PyTorch beyond tolerance; no bundle was published."""

    def __init__(self, message: str, results: dict[str, parity.ParityResult]):
        super().__init__(message)
        self.results = results


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


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One metadata key only: safetensors writes its metadata map in hash order (not reproducible)."""
    save_file({k: v.detach().float().contiguous().cpu() for k, v in tensors.items()}, str(path),
              metadata={"format": "pt"})


def write_bundle(model: FedMVP, clip: LoadedClip, classes: ClassSet, out: str | Path, *, images: torch.Tensor,
                 precision: str = "fp32", force: bool = False, source: dict[str, Any] | None = None,
                 image_note: dict[str, int] | None = None, calibration: torch.Tensor | None = None,
                 training: bool = True, progress: bool = False,
                 discard_device_state: bool = False, privacy: dict[str, Any] | None = None,
                 labels: np.ndarray | None = None,
                 max_accuracy_drop: float = DEFAULT_MAX_ACCURACY_DROP, ship_images: bool = True,
                 int8_scheme: str = "auto", real_calibration: int | None = None) -> BundleResult:
    """Export ``model`` (round tensors loaded) over ``classes`` into the bundle directory ``out``.

    ``calibration``: images that choose which layers int8 keeps in fp32 (default: ``images``;
    give other ones, e.g. training images, so that the parity check stays independent).
    ``labels``: the class index of each of ``images`` (-1: unknown); with at least ``parity.MIN_IMAGES``
    known, int8 keeps the fewest layers fp32 that hold the top-1 accuracy on those within
    ``max_accuracy_drop`` points (export/int8.py), else those that agree with fp32 on ``calibration``.
    ``int8_scheme``: dynamic, static or auto (export/int8_scheme.py); ``real_calibration``: how many of the
    calibration images are real (None: all; 0: auto is dynamic, static has nothing real to calibrate on).
    ``training=False``: an inference-only bundle, without the training program, and without the
    fp32 frozen weights when the ONNX model embeds its own (fp16, int8).
    ``discard_device_state``: with ``force``, also replace an ``out`` holding device state
    (``export.publish.device_state``); refused otherwise, since the device's training would be lost.
    ``privacy``: the manifest's ``privacy`` section (the run's [privacy] settings and the round's epsilon:
    what a device clips and noises by, docs/howto/privacy.md); None: none.
    ``ship_images``: the bundle's check images (what `edge-client --runtime auto` verifies on) are the first
    32 real ones of ``images`` (``image_note`` says how many are real and where from; export/check_images.py);
    False, or no real image: generated colour fields, so no test image leaves this machine."""
    out = Path(out)
    if precision not in PRECISIONS:
        raise ExportError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    check_out(out, force, discard_device_state)
    classes.validate()
    if len(images) < parity.MIN_IMAGES:
        raise ExportError(f"parity needs at least {parity.MIN_IMAGES} images, got {len(images)}")
    steps = ["text features", "onnx", "parity fp32"] + ([f"{precision}"] if precision != "fp32" else []) \
        + (["training artifact"] if training else []) + ["manifest"]
    names = bundle_roles(precision, training)
    bar = tqdm(total=len(steps), desc="export", unit="step", disable=not progress, file=sys.stderr, leave=False)

    def step(name: str) -> None:
        bar.set_postfix_str(name)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
    try:
        step("text features")
        features = text_features(clip, classes)
        model.set_text_features(features)
        edge = build_edge_classifier(model, features)
        weights_file = tmp / ROLES["weights"]  # the fp32 ONNX model's external data, at least for parity
        _save_safetensors(edge.frozen_tensors(), weights_file)
        _save_safetensors(edge.lora_tensors(), tmp / names["lora"])
        if "text" in names:  # what a refresh recomputes the baked text side from (docs/method.md §10)
            _save_safetensors({TEXT_FEATURES: features.reshape(-1, features.shape[-1])}, tmp / names["text"])
        bar.update()

        step("onnx export")
        graph = onnx_export.export_ir(edge, clip.image_size)
        proto = onnx_export.to_proto(onnx_export.fused(graph))  # fp32: ORT contrib fusions
        linked = onnx_export.link_external(proto, weights_file)
        external = onnx_export.external_names(proto)
        onnx_export.save(onnx_export.pin_classes(proto, list(classes.names)), tmp / names["onnx"])
        onnx_export.check(tmp / names["onnx"])
        bar.update()

        step("parity fp32")
        reference = parity.torch_logits(model, images)
        results = {"fp32": parity.check(tmp / names["onnx"], reference, images, "fp32")}
        if not results["fp32"].passed:
            raise ParityError(results["fp32"].line(), results)
        bar.update()

        int8_plan = None
        if precision == "fp16":
            step(precision)
            variant = onnx_export.to_fp16(graph, edge.lora_names)
        elif precision == "int8":
            step(precision)
            own = calibration is not None and len(calibration) > 0
            calib, calib_reference = (calibration, parity.torch_logits(model, calibration)) if own \
                else (images, reference)  # no calibration images of its own: the parity ones, logits reused
            variant, int8_plan = onnx_export.to_int8(graph, edge.lora_names, calib.numpy().astype("float32"),
                                                     calib_reference, parity.MIN_AGREEMENT["int8"], progress=step,
                                                     edge=edge, accuracy=accuracy_target(images, labels, reference,
                                                                                         max_accuracy_drop),
                                                     scheme=int8_scheme, real_calibration=real_calibration)
        if precision != "fp32":
            onnx_export.save(onnx_export.pin_classes(variant, list(classes.names)), tmp / names["onnx"])
            onnx_export.check(tmp / names["onnx"])
            results[precision] = parity.check(tmp / names["onnx"], reference, images, precision)
            linked, external = 0, None
            bar.update()

        if training:
            step("training artifact")
            program = training_artifact.export_program(edge, clip.image_size)
            training_artifact.save_program(program, tmp / names["training"])
            verify_program_archive(tmp / names["training"])
            bar.update()
        if "weights" not in names:
            weights_file.unlink()
        spec = preprocess_spec(clip)
        check = check_images.from_parity(images, image_note or {}, spec) if ship_images \
            else check_images.generated(spec)
        write_check_images(tmp / names["check"], check.pixels)

        step("manifest")
        manifest = _manifest(model, clip, classes, edge, precision, results, source or {},
                             image_note or {"given": len(images)}, linked, names, int8_plan)
        manifest["promptformer"] = promptformer_section(model, edge, external)
        manifest[CHECK_SECTION] = check.manifest(names["check"])
        if privacy is not None:
            manifest[PRIVACY] = dict(privacy)
        manifest["files"] = file_entries(tmp, list(names.values()))
        write_manifest(tmp, manifest)
        read_bundle(tmp)
        bar.update()
        discarded = publish(tmp, out, force, discard_device_state)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    sizes = {e: out.joinpath(e).stat().st_size for e in [*names.values(), MANIFEST]}
    return BundleResult(path=out, manifest=manifest, parity=results, sizes=sizes, int8=int8_plan,
                        discarded=discarded, check=check)


def accuracy_target(images: torch.Tensor, labels: np.ndarray | None, reference: np.ndarray,
                    max_drop: float) -> AccuracyTarget | None:
    """int8's task-accuracy bound on the labelled ones of ``images`` (their fp32 logits: rows of
    ``reference``); None with fewer than ``parity.MIN_IMAGES`` labelled (then: agreement with fp32)."""
    known = labels >= 0 if labels is not None else np.zeros(len(images), dtype=bool)
    if int(known.sum()) < parity.MIN_IMAGES:
        return None
    runner = onnx_export.calibration_runner(images[torch.from_numpy(known)].numpy().astype("float32"))
    return AccuracyTarget(reference[known], labels[known], max_drop, lambda model: runner(model, None))


def bundle_roles(precision: str, training: bool) -> dict[str, str]:
    """The files a bundle holds: an inference-only one drops the training program, and the frozen
    fp32 weights too unless the ONNX model reads them (fp32 stores its weights there). The attribute
    features are for a refresh, which needs the training program's parity check: trainable bundles only."""
    roles = dict(ROLES)
    if not training:
        del roles["training"], roles["text"]
        if precision != "fp32":
            del roles["weights"]
    return roles


def promptformer_section(model: FedMVP, edge: EdgeClassifier, external: set[str] | None) -> dict[str, Any]:
    """The manifest's ``promptformer``: the round's digest and how a refresh maps run tensors onto
    the bundle (docs/method.md §10). ``external``: the fp32 ONNX model's external initializers, which
    must include every tensor a refresh rewrites (None: the ONNX model embeds its weights)."""
    state = {k: v.detach().cpu().float().numpy() for k, v in model.state("promptformer").items()}
    copy = query_copy_map(model, edge)
    uncovered = sorted(set(state) - set(copy) - set(CONTEXT_SOURCES))
    absent = sorted(set(CONTEXT_SOURCES) - set(state))
    if uncovered or absent:
        raise ExportError(f"the PromptFormer does not fit {REFRESH_DERIVE} (neither copied nor derived: "
                          f"{', '.join(uncovered) or '-'}; missing: {', '.join(absent) or '-'})")
    read = {*copy.values(), *TEXT_CONSTANTS} - edge.unread_constants()
    embedded = sorted(read - external) if external is not None else []
    if embedded:
        raise ExportError(f"the fp32 ONNX model embeds {', '.join(embedded[:3])} instead of reading it from "
                          f"weights.safetensors: a refresh could not update it")
    return {"digest": promptformer_digest(state), "copy": dict(sorted(copy.items())), "derive": REFRESH_DERIVE,
            "norm_context_eps": float(model.promptformer.block.norm_context.eps)}


def _manifest(model: FedMVP, clip: LoadedClip, classes: ClassSet, edge, precision: str,
              results: dict[str, parity.ParityResult], source: dict[str, Any], image_note: dict[str, int],
              linked: int, names: dict[str, str], int8_plan: Int8Plan | None = None) -> dict[str, Any]:
    lora = edge.lora_tensors()
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "source": source,
        "model": {"clip": clip.name, "pretrained": clip.pretrained, "weights_identity": clip.identity,
                  "embed_dim": clip.embed_dim, "vision_width": clip.vision_width},
        "method": model.config.to_dict(),  # the record the weights were trained as (alpha, lora_rank, ...)
        "classes": {"names": list(classes.names), "count": len(classes.names),
                    "attributes_per_class": classes.k, "source": classes.source,
                    "digest": class_set_digest([(n, classes.attributes[n]) for n in classes.names])},
        "preprocess": preprocess_spec(clip).to_manifest(),
        "precision": precision,
        "files_by_role": dict(names),
        "onnx": {"file": names["onnx"], "opset": onnx_export.OPSET, "input": onnx_export.INPUT_NAME,
                 "outputs": list(onnx_export.OUTPUT_NAMES), "batch": "dynamic", "num_classes": len(classes.names),
                 "external_data": [names["weights"]] if linked else [], "external_bytes": linked,
                 "numerics": int8_plan.numerics() if int8_plan else NUMERICS[precision],
                 "lora_initializers": list(edge.lora_names),
                 **({"int8": int8_plan.to_manifest()} if int8_plan else {})},
        "training": {"file": names["training"], "format": "torch.export", "torch_version": torch.__version__,
                     "load": "torch.export.load(path).module()",
                     "inputs": list(training_artifact.INPUT_NAMES), "outputs": list(training_artifact.OUTPUT_NAMES),
                     "weights_file": names["weights"], "trainable": "lora", "dict_keys": "sorted"}
        if "training" in names else None,
        "lora": {"file": names["lora"], "scaling": lora_scaling(model),
                 "tensors": {k: list(v.shape) for k, v in lora.items()}},
        "parity": {"images": image_note, **{k: r.to_manifest() for k, r in results.items()}},
    }


# ---- the run-reading layer ------------------------------------------------------------------------
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


def export_bundle(run: str | Path | None = None, round_number: int | None = None, out: str | Path | None = None,
                  *, precision: str = "fp32", force: bool = False, attributes: str | Path | None = None,
                  domain: str | None = None, parity_images: int = DEFAULT_PARITY_IMAGES, training: bool = True,
                  progress: bool = False, runs_root: str | Path = "runs",
                  discard_device_state: bool = False, images: str | Path | None = None,
                  max_accuracy_drop: float | None = None, ship_images: bool = True,
                  int8_scheme: str | None = None) -> BundleResult:
    """Export round ``round_number`` (default: the last complete one) of ``run`` (default: the newest).

    Needs the run directory only: the class set is the run's record; parity runs on ``images`` (a folder,
    walked recursively) when given, else on the run's test images where reachable, else on generated
    pixels with one warning line (``export.run_inputs.export_images``). ``max_accuracy_drop``: int8's
    bound in points on the labelled ones of those images (default 1.0; int8 only). ``ship_images``: the first
    32 of those images travel in the bundle as its check images (False: generated ones; `--no-check-images`).
    ``int8_scheme``: auto (default), dynamic or static (export/int8_scheme.py; without real calibration
    images auto is dynamic)."""
    if precision not in PRECISIONS:
        raise ExportError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    if max_accuracy_drop is not None and precision != "int8":
        raise ExportError(f"--max-accuracy-drop applies to --precision int8, not {precision}")
    if max_accuracy_drop is not None and not max_accuracy_drop >= 0:
        raise ExportError(f"--max-accuracy-drop must be 0 or more points, got {max_accuracy_drop}")
    if int8_scheme is not None and precision != "int8":
        raise ExportError(f"--int8-scheme applies to --precision int8, not {precision}")
    if parity_images < parity.MIN_IMAGES:
        raise ExportError(f"--parity-images must be at least {parity.MIN_IMAGES}")
    run_dir = find_run(run, Path(runs_root))
    config = read_config(run_dir)
    checkpoint = load_checkpoint(run_dir, round_number)
    try:  # [privacy]: what the round has spent, read before anything is built or written
        privacy = round_privacy(run_dir, checkpoint.round)
    except RunError as err:
        raise ExportError(str(err)) from None
    target = Path(out) if out is not None else default_out(run_dir.path, checkpoint.round, precision)
    check_out(target, force, discard_device_state)
    folder = images_folder(images)
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
              "round": checkpoint.round,
              "checkpoint_sha256": sha256_file(ckpt_path), "lora_clients": checkpoint.state.get("lora_clients")}
    return write_bundle(model, clip, classes, target, images=chosen.parity, precision=precision, force=force,
                        source=source, image_note=chosen.note, calibration=chosen.calibration, training=training,
                        progress=progress, discard_device_state=discard_device_state,
                        privacy=privacy, labels=chosen.labels,
                        max_accuracy_drop=DEFAULT_MAX_ACCURACY_DROP if max_accuracy_drop is None else max_accuracy_drop,
                        ship_images=ship_images, int8_scheme=int8_scheme or "auto",
                        real_calibration=chosen.calibration_real)
