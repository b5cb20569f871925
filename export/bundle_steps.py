"""The steps of writing one bundle into its temporary directory, and what they are given.

``export.bundle_writer.write_bundle`` checks its arguments, runs ``BundleWrite`` in ``OUT.tmp-xxxx`` and
publishes the result; each step here writes or checks one part (the tensors, the fp32 ONNX model and
its parity, the fp16/int8 variant, the training program, the check images and the manifest) and is one
step of the progress bar. ``BundleOptions`` (how: the flags of ``fedmvp-export``) and ``BundleInputs``
(what from: images and records) replace the long argument lists of the writer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from fedmvp_formats.artifact_requirements import REQUIRES, requirements_section
from fedmvp_formats.bundle_manifest import EXECUTORCH_FILE, EXECUTORCH_ROLE
from fedmvp_formats.bundle_manifest import (CHECK_SECTION, CONTEXT_SOURCES, FORMAT, FORMAT_VERSION,
                                            REFRESH_DERIVE, ROLES, TEXT_CONSTANTS, TEXT_FEATURES, TORCHSCRIPT_FILE,
                                            TORCHSCRIPT_ROLE, TORCHSCRIPT_TRAINING_FILE, TORCHSCRIPT_TRAINING_ROLE,
                                            file_entries, write_manifest)
from fedmvp_formats.class_set import class_set_digest
from fedmvp_formats.privacy import RECORD as PRIVACY
from fedmvp_formats.promptformer import promptformer_digest

from edge_client.bundle import read_bundle, verify_program_archive
from edge_client.check_images import write_check_images
from export import check_images, onnx_export, parity, torchscript_export, torchscript_training, training_artifact
from export import executorch_export
from export.class_set import ClassSet, text_features
from export.edge_module import EdgeClassifier, build_edge_classifier, lora_scaling, query_copy_map
from export.errors import ExportError
from export.int8 import DEFAULT_MAX_ACCURACY_DROP, AccuracyTarget, Int8Plan
from export.run_inputs import preprocess_spec
from fedmvp.clip import LoadedClip
from fedmvp.model import FedMVP

NUMERICS = {"fp32": "fp32 weights and compute",
            "fp16": "fp16 weights and compute; pixel_values, outputs and LoRA initializers fp32",
            "int8": "int8 of the MatMul weights (onnx.int8.scheme)"}  # the plan says how: Int8Plan.numerics


class ParityError(RuntimeError):
    """fp32 ONNX Runtime output differs from PyTorch beyond tolerance; no bundle was published."""

    def __init__(self, message: str, results: dict[str, parity.ParityResult]):
        super().__init__(message)
        self.results = results


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One metadata key only: safetensors writes its metadata map in hash order (not reproducible)."""
    save_file({k: v.detach().float().contiguous().cpu() for k, v in tensors.items()}, str(path),
              metadata={"format": "pt"})


@dataclass(frozen=True)
class BundleOptions:
    """How a bundle is written (``write_bundle``; the flags of ``fedmvp-export``)."""

    precision: str = "fp32"  # the ONNX model's numerics: fp32, fp16 or int8 (bundle_manifest.PRECISIONS)
    force: bool = False  # replace an existing ``out``, once the new bundle is complete and verified
    # with ``force``, also replace an ``out`` holding device state (``export.publish.device_state``);
    # refused otherwise, since the device's training would be lost
    discard_device_state: bool = False
    # False: an inference-only bundle, without the training program, and without the fp32 frozen
    # weights when the ONNX model embeds its own (fp16, int8)
    training: bool = True
    # the bundle's check images (what `edge-client --runtime auto` verifies on) are the first 32 real
    # parity images; False, or no real image: generated colour fields, so no test image leaves this machine
    ship_images: bool = True
    # int8: the bound in points on the labelled parity images (None: DEFAULT_MAX_ACCURACY_DROP; export/int8.py)
    max_accuracy_drop: float | None = None
    int8_scheme: str | None = None  # int8: auto, dynamic or static (None: auto; export/int8_scheme.py)
    progress: bool = False  # a progress bar on stderr
    # also write the TorchScript inference module (export/torchscript_export.py), parity-checked like ONNX
    torchscript: bool = False
    # also write the ExecuTorch program for phones (export/executorch_export.py), parity-checked like ONNX
    executorch: bool = False


@dataclass(frozen=True)
class BundleInputs:
    """What a bundle is written from besides the model and its class set: images and records."""

    images: torch.Tensor  # the parity images (at least ``parity.MIN_IMAGES``), preprocessed
    labels: np.ndarray | None = None  # the class index of each image (-1: unknown); int8's accuracy bound
    # images that choose which layers int8 keeps in fp32 (None: ``images``; other ones, e.g. training
    # images, keep the parity check independent)
    calibration: torch.Tensor | None = None
    real_calibration: int | None = None  # how many calibration images are real (None: all; 0: auto is dynamic)
    image_note: dict[str, int] | None = None  # how many images are real and where from (the manifest's parity)
    source: dict[str, Any] | None = None  # the manifest's ``source``: run, round, checkpoint
    # the manifest's ``privacy`` section (the run's [privacy] settings and the round's epsilon: what a
    # device clips and noises by, docs/howto/privacy.md); None: none
    privacy: dict[str, Any] | None = None


class BundleWrite:
    """One bundle being written into ``tmp``: its steps in order (``run``), each one tqdm step."""

    def __init__(self, tmp: Path, model: FedMVP, clip: LoadedClip, classes: ClassSet, inputs: BundleInputs,
                 options: BundleOptions, bar: Any) -> None:
        self.tmp, self.model, self.clip, self.classes = tmp, model, clip, classes
        self.inputs, self.options, self.bar = inputs, options, bar
        self.names = bundle_roles(options.precision, options.training)
        if options.torchscript:
            self.names[TORCHSCRIPT_ROLE] = TORCHSCRIPT_FILE
            if options.training:  # and what train.pt2 computes, for a torch that cannot load it
                self.names[TORCHSCRIPT_TRAINING_ROLE] = TORCHSCRIPT_TRAINING_FILE
        if options.executorch:
            self.names[EXECUTORCH_ROLE] = EXECUTORCH_FILE
        self.results: dict[str, parity.ParityResult] = {}
        self.int8_plan: Int8Plan | None = None
        self.training_parity: torchscript_training.TrainingParity | None = None
        self.check: check_images.ShippedCheck | None = None

    def step(self, name: str) -> None:
        self.bar.set_postfix_str(name)

    def run(self) -> dict[str, Any]:
        """Every file, checked, then the manifest; returns the manifest (the bundle read back once)."""
        self.tensors()
        graph = self.onnx()
        reference = self.parity_fp32()
        self.variant(graph, reference)
        if self.options.torchscript:
            self.torchscript(reference)
        if self.options.executorch:
            self.executorch(reference)
        if self.options.training:
            self.program()
        if TORCHSCRIPT_TRAINING_ROLE in self.names:
            self.torchscript_training()
        if "weights" not in self.names:
            self.weights_file.unlink()
        return self.manifest()

    def tensors(self) -> None:
        """The text features baked into the model, and the safetensors files of its tensors."""
        self.step("text features")
        tmp, names = self.tmp, self.names
        self.features = text_features(self.clip, self.classes)
        self.model.set_text_features(self.features)
        self.edge = build_edge_classifier(self.model, self.features)
        self.weights_file = tmp / ROLES["weights"]  # the fp32 ONNX model's external data, at least for parity
        _save_safetensors(self.edge.frozen_tensors(), self.weights_file)
        _save_safetensors(self.edge.lora_tensors(), tmp / names["lora"])
        if "text" in names:  # what a refresh recomputes the baked text side from (docs/method.md §10)
            _save_safetensors({TEXT_FEATURES: self.features.reshape(-1, self.features.shape[-1])}, tmp / names["text"])
        self.bar.update()

    def onnx(self) -> Any:
        """The fp32 ONNX model (its weights external), checked; returns its graph for the variants."""
        self.step("onnx export")
        onnx_path = self.tmp / self.names["onnx"]
        graph = onnx_export.export_ir(self.edge, self.clip.image_size)
        proto = onnx_export.to_proto(onnx_export.fused(graph))  # fp32: ORT contrib fusions
        self.linked = onnx_export.link_external(proto, self.weights_file)
        self.external: set[str] | None = onnx_export.external_names(proto)
        onnx_export.save(onnx_export.pin_classes(proto, list(self.classes.names)), onnx_path)
        onnx_export.check(onnx_path)
        self.bar.update()
        return graph

    def parity_fp32(self) -> np.ndarray:
        """PyTorch's logits on the parity images, and the fp32 model's parity (``ParityError``: none written)."""
        self.step("parity fp32")
        images = self.inputs.images
        reference = parity.torch_logits(self.model, images)
        self.results["fp32"] = parity.check(self.tmp / self.names["onnx"], reference, images, "fp32")
        if not self.results["fp32"].passed:
            raise ParityError(self.results["fp32"].line(), self.results)
        self.bar.update()
        return reference

    def variant(self, graph: Any, reference: np.ndarray) -> None:
        """fp16 or int8: the model in that precision replaces the fp32 one, with its own parity."""
        precision, inputs, onnx_path = self.options.precision, self.inputs, self.tmp / self.names["onnx"]
        if precision == "fp32":
            return
        self.step(precision)
        if precision == "fp16":
            variant = onnx_export.to_fp16(graph, self.edge.lora_names)
        else:
            own = inputs.calibration is not None and len(inputs.calibration) > 0
            calib, calib_reference = (inputs.calibration, parity.torch_logits(self.model, inputs.calibration)) \
                if own else (inputs.images, reference)  # no calibration images of its own: the parity ones, logits reused
            drop = self.options.max_accuracy_drop
            accuracy = accuracy_target(inputs.images, inputs.labels, reference,
                                       DEFAULT_MAX_ACCURACY_DROP if drop is None else drop)
            variant, self.int8_plan = onnx_export.to_int8(
                graph, self.edge.lora_names, calib.numpy().astype("float32"), calib_reference,
                parity.MIN_AGREEMENT["int8"], progress=self.step, edge=self.edge, accuracy=accuracy,
                scheme=self.options.int8_scheme or "auto", real_calibration=inputs.real_calibration)
        onnx_export.save(onnx_export.pin_classes(variant, list(self.classes.names)), onnx_path)
        onnx_export.check(onnx_path)
        self.results[precision] = parity.check(onnx_path, reference, inputs.images, precision)
        self.linked, self.external = 0, None
        self.bar.update()

    def torchscript(self, reference: np.ndarray) -> None:
        """The TorchScript module, held to the fp32 parity rules like the ONNX model (``ParityError``: none written)."""
        self.step("torchscript")
        self.results[TORCHSCRIPT_ROLE] = torchscript_export.write_checked(
            self.edge, self.clip.image_size, self.tmp / self.names[TORCHSCRIPT_ROLE], reference, self.inputs.images)
        if not self.results[TORCHSCRIPT_ROLE].passed:
            raise ParityError(self.results[TORCHSCRIPT_ROLE].line(), self.results)
        self.bar.update()

    def executorch(self, reference: np.ndarray) -> None:
        """The ExecuTorch program, held to the fp32 parity rules like the ONNX model (``ParityError``: none written)."""
        self.step("executorch")
        self.results[EXECUTORCH_ROLE] = executorch_export.write_checked(
            self.edge, self.clip.image_size, self.tmp / self.names[EXECUTORCH_ROLE], reference, self.inputs.images)
        if not self.results[EXECUTORCH_ROLE].passed:
            raise ParityError(self.results[EXECUTORCH_ROLE].line(), self.results)
        self.bar.update()

    def program(self) -> None:
        """The torch.export training program (LoRA the only trainable inputs), verified as a device reads it."""
        self.step("training artifact")
        program = training_artifact.export_program(self.edge, self.clip.image_size)
        training_artifact.save_program(program, self.tmp / self.names["training"])
        verify_program_archive(self.tmp / self.names["training"])
        self.bar.update()

    def torchscript_training(self) -> None:
        """The TorchScript training module, its outputs and LoRA gradients held to the eager module's
        (``ParityError``: none written)."""
        self.step("torchscript training")
        found = torchscript_training.write_checked(self.edge, self.clip.image_size,
                                                   self.tmp / self.names[TORCHSCRIPT_TRAINING_ROLE], self.inputs.images)
        if not found.passed:
            raise ParityError(found.line(), self.results)
        self.training_parity = found
        self.bar.update()

    def manifest(self) -> dict[str, Any]:
        """The check images, then the manifest over every file; the bundle is read back as a device would."""
        tmp, names, inputs, images = self.tmp, self.names, self.inputs, self.inputs.images
        spec = preprocess_spec(self.clip)
        self.check = check_images.from_parity(images, inputs.image_note or {}, spec) if self.options.ship_images \
            else check_images.generated(spec)
        write_check_images(tmp / names["check"], self.check.pixels)
        self.step("manifest")
        manifest = _manifest(self.model, self.clip, self.classes, self.edge, self.options.precision, self.results,
                             inputs.source or {}, inputs.image_note or {"given": len(images)}, self.linked, names,
                             self.int8_plan)
        manifest["promptformer"] = promptformer_section(self.model, self.edge, self.external)
        manifest[CHECK_SECTION] = self.check.manifest(names["check"])
        if TORCHSCRIPT_ROLE in names:
            manifest[TORCHSCRIPT_ROLE] = torchscript_export.manifest_section(
                self.edge, manifest["promptformer"]["digest"])
        if self.training_parity is not None:
            manifest[TORCHSCRIPT_TRAINING_ROLE] = torchscript_training.manifest_section(self.edge, self.training_parity)
        if EXECUTORCH_ROLE in names:
            manifest[EXECUTORCH_ROLE] = executorch_export.manifest_section(
                self.edge, manifest["promptformer"]["digest"])
        if inputs.privacy is not None:
            manifest[PRIVACY] = dict(inputs.privacy)
        try:  # what a device needs to run each file (fedmvp_formats/artifact_requirements.py)
            manifest[REQUIRES] = requirements_section(manifest)
        except ValueError as err:
            raise ExportError(str(err)) from None
        manifest["files"] = file_entries(tmp, list(names.values()))
        write_manifest(tmp, manifest)
        read_bundle(tmp)
        self.bar.update()
        return manifest


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
