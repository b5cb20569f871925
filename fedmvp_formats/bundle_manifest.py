"""The edge bundle's manifest and the refresh's names: one definition for the writer and the readers.

Why here: ``export`` writes a bundle's manifest.json and ``edge_client`` reads, verifies and
refreshes it (``bundle``, ``bundle_files``, ``refresh``, ``journal``); the format name and version,
the sections and their types, the file names and the folders a device adds were constants of the
reader that the writer imported. Here they are the format's, and ``check_manifest`` is what both
hold a manifest to: the exporter reads its bundle back through it before publishing it.

manifest.json is covered by no hash (its own sha256 is the bundle's identity), so ``check_manifest``
checks every section's type and that the sections agree with each other before a reader looks inside;
what needs a bundle's files (hashes, the ONNX model's class pin, the preprocessing) the reader checks.
The layout and the meaning of each section: ``edge_client/bundle.py`` and docs/method.md §10.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedmvp_formats.artifact_requirements import REQUIRES, check_requires
from fedmvp_formats.atomic import write_bytes
from fedmvp_formats.files import sha256_file
from fedmvp_formats.method import MethodRecord
from fedmvp_formats.names import PROMPTFORMER_PREFIX
from fedmvp_formats.privacy import RECORD as PRIVACY
from fedmvp_formats.privacy import PrivacyRecord

FORMAT = "fedmvp-edge-bundle"
FORMAT_VERSION = 2  # 2: the manifest records the method config (``method``)
MANIFEST = "manifest.json"
# The files a bundle holds, by role (an inference-only bundle drops training, text and maybe weights).
ROLES = {"onnx": "model.onnx", "weights": "weights.safetensors", "lora": "lora.safetensors",
         "training": "train.pt2", "text": "text_features.safetensors", "check": "check_images.safetensors"}
REQUIRED_ROLES = ("onnx", "lora")
# ``check``: the pictures `edge-client --runtime auto` verifies a runtime on (section ``check_images``). One
# uint8 tensor CHECK_TENSOR [N, S, S, 3]: RGB after the bundle's resize and crop, before normalisation (the
# device normalises by ``preprocess`` as it does a file; 4x smaller than float32 and exact). Where they came
# from: ``--images``, the run's recorded test images, or generated colour fields (``--no-check-images``, or
# no real image at export). Bundles exported before have neither: the device generates its own from the id.
CHECK_SECTION = "check_images"
CHECK_TENSOR = "images"
CHECK_SOURCES = ("images", "run-test", "generated")
MAX_CHECK_IMAGES = 256
# ``torchscript`` (optional, `fedmvp-export --format torchscript`): the inference module ONNX is exported from,
# traced (torch.jit) with its LoRA tensors as inputs; section TORCHSCRIPT_ROLE names the role's file. Absent
# (older bundles, or not asked for): no TorchScript artifact, and `edge-client --runtime torchscript` is not offered.
TORCHSCRIPT_ROLE = "torchscript"
TORCHSCRIPT_FILE = "model.torchscript.pt"
TORCHSCRIPT_FORMAT = "torch.jit"
# ``torchscript_training`` (optional, trainable bundles exported with --format torchscript): what train.pt2
# computes, traced (torch.jit) with every tensor an input (export/torchscript_training.py); the device trains
# through it where train.pt2 does not load (docs/howto/torchscript.md).
TORCHSCRIPT_TRAINING_ROLE = "torchscript_training"
TORCHSCRIPT_TRAINING_FILE = "train.torchscript.pt"
# ``executorch`` (optional, `fedmvp-export --format executorch`): the same module lowered to ExecuTorch (XNNPACK),
# its LoRA tensors as inputs, for phones (docs/howto/executorch.md). Absent: `--runtime executorch` is not offered.
EXECUTORCH_ROLE = "executorch"
EXECUTORCH_FILE = "model.pte"
EXECUTORCH_FORMAT = "executorch.pte"
PRECISIONS = ("fp32", "fp16", "int8")
CLASSES_KEY = "fedmvp.classes_sha256"  # model.onnx metadata_props: the class list it was exported with
# ``onnx.int8`` of an int8 bundle (export/int8.py's plan): the MatMul layers ``quantized`` and ``kept_fp32``,
# the ``criterion`` that chose them and, for "accuracy", what it measured on labelled held-out images
# (top-1 accuracies as fractions, the drop and its bound in points, top-1 agreement with fp32).
INT8_CRITERIA = ("accuracy", "agreement")
# ``onnx.int8.scheme``: how the quantised layers compute, "dynamic" (MatMulInteger, activations quantised per
# call; what a manifest without the key means) or "static" (QDQ, activation ranges calibrated at export).
INT8_SCHEMES = ("dynamic", "static")
INT8_ACCURACY = ("images", "fp32", "int8", "drop_points", "max_drop_points", "top1_agreement")

_SHA256 = re.compile(r"[0-9a-f]{64}")
# Top-level sections: (the types a value may have, required). ``source`` and ``promptformer`` are optional
# within format 2 (a bundle without them cannot be refreshed); ``training`` is None for inference only.
SECTIONS: dict[str, tuple[tuple[type, ...], bool]] = {
    "format": ((str,), True), "format_version": ((int,), True), "files": ((dict,), True),
    "method": ((dict,), True), "classes": ((dict,), True), "preprocess": ((dict,), True),
    "precision": ((str,), True), "files_by_role": ((dict,), True), "lora": ((dict,), True),
    "source": ((dict,), False), "model": ((dict,), False), "onnx": ((dict,), False),
    "training": ((dict, type(None)), False), "parity": ((dict,), False), "promptformer": ((dict,), False),
    PRIVACY: ((dict,), False),  # the run's [privacy] settings and the round's epsilon (none: no DP)
    CHECK_SECTION: ((dict,), False),  # absent in bundles exported before check images travelled
    TORCHSCRIPT_ROLE: ((dict,), False),  # absent: no TorchScript artifact
    TORCHSCRIPT_TRAINING_ROLE: ((dict,), False),  # absent: no TorchScript training module
    REQUIRES: ((dict,), False),  # absent in bundles exported before: the device checks no versions
    EXECUTORCH_ROLE: ((dict,), False),  # absent: no ExecuTorch program
}

# What each section holds (the reference page docs/reference/bundle.md is generated from SECTIONS and this).
SECTION_HELP: dict[str, str] = {
    "format": f"always {FORMAT!r}",
    "format_version": f"{FORMAT_VERSION}; a reader refuses any other with one line saying to re-export",
    "files": "every file of the bundle: {name: {sha256, bytes}}; the manifest's own sha256 is the bundle's id",
    "method": "the method record the weights were trained as (num_prompts, heads, alpha, flip_prob, lora_rank, "
              "lora_targets, use_lora; docs/method.md §3-5): `edge-client train` takes its alpha from it",
    "classes": "names (in logit order, unique), count, attributes_per_class, source (the run or --attributes), "
               "digest (the class-set digest of the names and phrases, ``fedmvp_formats.class_set``; absent in "
               "bundles exported before it was recorded)",
    "preprocess": "image size, resize and crop, mean and std: what the device does to an image before the model",
    "precision": "the ONNX model's precision: " + ", ".join(PRECISIONS),
    "files_by_role": "{role: file name} for the roles below; onnx and lora are required",
    "lora": "file, scaling, and tensors: {name: shape} of the LoRA tensors an update file must match",
    "source": "the run and round its weights come from (run_id; after a refresh: the run and round it was "
              "refreshed to, refreshed_from the old bundle id, refreshed_from_run the old run where it changed), "
              "and base_digest: that round's state (fedmvp_formats.promptformer.base_digest), which an update "
              "trained on the bundle names as its base",
    "model": "the CLIP backbone: clip, pretrained, weights_identity, embed_dim, vision_width",
    "onnx": "file, opset, input and outputs, num_classes, external data, numerics, LoRA initializer names, "
            "int8 (the scheme, the layers kept fp32)",
    "training": "the torch.export training program (file, inputs, outputs, trainable: lora); null in an "
                "inference-only bundle",
    "parity": "ONNX Runtime against PyTorch at export: images used, per precision max |logit diff| and top-1 "
              "agreement, passed",
    "promptformer": "digest of the PromptFormer it holds, copy map and derivation: what a refresh to a later "
                    "round needs (docs/method.md §10)",
    PRIVACY: "the run's [privacy] settings (clip_norm, noise_multiplier, target_delta, mode, max_epsilon) and "
             "the epsilon spent up to the exported round; absent without differential privacy",
    CHECK_SECTION: "the pictures `edge-client --runtime auto` verifies runtimes on: file (role check), source "
                   f"({', '.join(CHECK_SOURCES)}: --images, the run's test images, generated colour fields), "
                   "images (count), generated (how many of them are generated), layout; absent in bundles "
                   "exported before (the device then generates its own from the bundle id)",
    TORCHSCRIPT_ROLE: "the TorchScript inference module (fedmvp-export --format torchscript): file (role "
                      "torchscript), format, inputs (pixel_values, then the LoRA tensors), outputs, the PromptFormer "
                      "digest baked in; absent when the bundle carries none",
    TORCHSCRIPT_TRAINING_ROLE: "the TorchScript training module (trainable bundles exported with --format "
                               "torchscript): file (role torchscript_training), format, inputs (pixel_values, "
                               "consistency_view, the LoRA tensors, the frozen weights, each group sorted), "
                               "outputs, lora_inputs, weight_inputs, parity against PyTorch (outputs and LoRA "
                               "gradients); what the device trains through where train.pt2 does not load",
    REQUIRES: "what a device needs to run each file, by role: file, and needs {package: {min, below, why}} (the "
              "packages that can read it, e.g. model.onnx: onnxruntime by the ONNX opset, or openvino; train.pt2: "
              "torch); `edge-client info` shows it, and a runtime whose package is outside the range is refused "
              "before it loads (fedmvp_formats/artifact_requirements.py; absent in bundles exported before)",
    EXECUTORCH_ROLE: "the ExecuTorch program for phones (fedmvp-export --format executorch): file (role executorch), "
                     "format, backend, method, batch (images per call), inputs (pixel_values, then the LoRA "
                     "tensors), outputs, the PromptFormer digest baked in; absent when the bundle carries none",
}

# What a device adds to a bundle directory, and a refresh's names (edge_client.refresh, edge_client.journal).
PERSONALISED = "personalised"  # the device's own LoRAs (edge_client.lora_store)
DEVICE_ID_FILE = "device-id"  # the device's random id, which its update files carry (edge_client.device_id)
PREVIOUS = "previous"  # what the last refresh replaced, for `edge-client rollback --refresh`
REFRESH_JOURNAL = "refresh.json"  # present only while a refresh or its rollback is under way
JOURNAL_FORMAT = "fedmvp-edge-refresh-journal"
JOURNAL_VERSION = 1
REFRESH_NEW = ".refresh-new"  # the new files, staged
REFRESH_PREVIOUS = ".refresh-previous"  # what will become previous/
REFRESH_DISCARD = ".refresh-discard"  # what goes once the change is complete
REFRESH_SCRATCH = (REFRESH_NEW, REFRESH_PREVIOUS, REFRESH_DISCARD)

# How a refresh derives the baked text constants (``promptformer.derive``, docs/method.md §10): from
# text_features.safetensors' TEXT_FEATURES and the run tensors of CONTEXT_LAYERS.
REFRESH_DERIVE = "fedmvp-context-v1"
TEXT_FEATURES = "text.attribute_features"  # [C*K, E]: what the PromptFormer's text_proj receives
TEXT_CONSTANTS = ("text.key_context", "text.value_context", "text.key_base", "text.value_base")
CONTEXT_LAYERS = {layer: PROMPTFORMER_PREFIX + name for layer, name in (
    ("text_proj", "text_proj"), ("norm_context", "block.norm_context"), ("to_k", "block.attn.to_k"),
    ("to_v", "block.attn.to_v"))}
CONTEXT_SOURCES = tuple(f"{layer}.{leaf}" for layer in CONTEXT_LAYERS.values() for leaf in ("weight", "bias"))


class ManifestError(ValueError):
    """A manifest that breaks the format; one line naming the manifest and the field."""


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_manifest(m: Any, where: str) -> MethodRecord:
    """Hold ``m`` to the format (``where``: the manifest's path as an error names it); its method record.

    Why one function: the exporter and every reader refuse the same manifests with the same line."""
    def bad(field: str, why: str) -> ManifestError:
        return ManifestError(f"{where}: field {field}: {why}")

    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ManifestError(f"{where}: not a {FORMAT} manifest")
    version = m.get("format_version")
    if version != FORMAT_VERSION:
        raise ManifestError(f"{where}: format version {version} is not supported (this client reads "
                            f"{FORMAT_VERSION}); re-export the bundle or update edge-client")
    for key, (kinds, required) in SECTIONS.items():
        if key not in m:
            if required:
                raise bad(key, "missing (re-export the bundle with this version of fedmvp-export)")
            continue
        value = m[key]
        if not isinstance(value, kinds) or (int in kinds and isinstance(value, bool)):
            names = " or ".join("a mapping" if k is dict else "null" if k is type(None) else f"a {k.__name__}"
                                for k in kinds)
            raise bad(key, f"must be {names}, got {type(value).__name__}")
    _check_files(m["files"], bad)
    try:
        method = MethodRecord.from_dict(m["method"], f"{where}: field method")
    except ValueError as err:
        raise ManifestError(f"{err}; re-export the bundle with this version of fedmvp-export") from None
    _check_classes(m, bad)
    _check_int8((m.get("onnx") or {}).get("int8"), bad)
    if m["precision"] not in PRECISIONS:
        raise bad("precision", f"{m['precision']!r} is not one of {', '.join(PRECISIONS)}")
    roles = m["files_by_role"]
    if not all(isinstance(v, str) and v in m["files"] for v in roles.values()) \
            or not all(r in roles for r in REQUIRED_ROLES):
        raise bad("files_by_role", "must name the onnx and lora files, each one listed in files")
    tensors = m["lora"].get("tensors")
    if not isinstance(tensors, dict) or not tensors or not all(
            isinstance(s, list) and all(_integer(d) and d > 0 for d in s) for s in tensors.values()):
        raise bad("lora.tensors", "not a mapping of LoRA tensor names to shapes (lists of positive ints)")
    source = m.get("source") or {}
    if source.get("round") is not None and not (_integer(source["round"]) and source["round"] >= 0):
        raise bad("source.round", f"not a round number, got {source['round']!r}")
    if source.get("run_id") is not None and not isinstance(source["run_id"], str):
        raise bad("source.run_id", f"not a string, got {type(source['run_id']).__name__}")
    if source.get("base_digest") is not None and not (isinstance(source["base_digest"], str)
                                                      and _SHA256.fullmatch(source["base_digest"])):
        raise bad("source.base_digest", "not a sha256 hex digest")
    _check_check_images(m, bad)
    _check_artifact(m, bad, TORCHSCRIPT_ROLE, TORCHSCRIPT_FORMAT)
    _check_artifact(m, bad, TORCHSCRIPT_TRAINING_ROLE, TORCHSCRIPT_FORMAT)
    _check_artifact(m, bad, EXECUTORCH_ROLE, EXECUTORCH_FORMAT)
    check_requires(m.get(REQUIRES), roles, bad)
    if PRIVACY in m:  # what the device clips (and noises) by: the one record's checks
        try:
            PrivacyRecord.from_record(m[PRIVACY], f"{where}: field {PRIVACY}")
        except ValueError as err:
            raise ManifestError(str(err)) from None
    return method


def _check_files(files: dict[str, Any], bad: Any) -> None:
    """``files``: at least one, each ``{sha256: 64 hex digits, bytes: a size}`` (the names: the reader's)."""
    if not files:
        raise bad("files", "lists no files")
    for name, entry in files.items():
        if not isinstance(entry, dict) or not _integer(entry.get("bytes")) or entry["bytes"] < 0 \
                or not isinstance(entry.get("sha256"), str) or len(entry["sha256"]) != 64 \
                or not set(entry["sha256"]) <= set("0123456789abcdef"):
            raise bad(f"files[{name!r}]", "must be {\"sha256\": 64 hex digits, \"bytes\": a size}")


def _check_classes(m: dict[str, Any], bad: Any) -> None:
    """The class list: unique non-empty names, as many as ``classes.count`` and the model's outputs."""
    names, count = m["classes"].get("names"), m["classes"].get("count")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise bad("classes.names", "not a non-empty list of class names")
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise bad("classes.names", f"names a class twice ({', '.join(twice[:5])})")
    if not _integer(count) or count != len(names):
        raise bad("classes.count", f"{count!r}, but classes.names lists {len(names)}")
    digest = m["classes"].get("digest")
    if digest is not None and not (isinstance(digest, str) and len(digest) == 64 and set(digest) <= set("0123456789abcdef")):
        raise bad("classes.digest", "not a sha256 hex digest")
    outputs = (m.get("onnx") or {}).get("num_classes")
    if outputs is not None and outputs != len(names):
        raise bad("onnx.num_classes", f"the model outputs {outputs!r} classes, classes.names lists {len(names)}")


def _check_int8(plan: Any, bad: Any) -> None:
    """``onnx.int8``, where present: layer lists of names; the criterion (absent in bundles exported before
    it was recorded: agreement) and, for "accuracy", every measured figure a number; the scheme (absent
    before it was recorded: dynamic, the only one then)."""
    if plan is None:
        return
    if not isinstance(plan, dict):
        raise bad("onnx.int8", f"must be a mapping, got {type(plan).__name__}")
    for key in ("quantized", "kept_fp32"):
        if not isinstance(plan.get(key), list) or not all(isinstance(n, str) for n in plan[key]):
            raise bad(f"onnx.int8.{key}", "not a list of layer names")
    criterion = plan.get("criterion", "agreement")
    if criterion not in INT8_CRITERIA:
        raise bad("onnx.int8.criterion", f"{criterion!r} is not one of {', '.join(INT8_CRITERIA)}")
    scheme = plan.get("scheme", "dynamic")
    if scheme not in INT8_SCHEMES:
        raise bad("onnx.int8.scheme", f"{scheme!r} is not one of {', '.join(INT8_SCHEMES)}")
    accuracy = plan.get("accuracy")
    if criterion == "accuracy" and (not isinstance(accuracy, dict) or not all(
            isinstance(accuracy.get(k), (int, float)) and not isinstance(accuracy.get(k), bool)
            for k in INT8_ACCURACY)):
        raise bad("onnx.int8.accuracy", f"criterion accuracy needs numbers {', '.join(INT8_ACCURACY)}")


def _check_check_images(m: dict[str, Any], bad: Any) -> None:
    """``check_images`` and the ``check`` role come together; the section names the role's file, a source of
    CHECK_SOURCES and counts (the tensor itself the reader checks against its header)."""
    section, role = m.get(CHECK_SECTION), m["files_by_role"].get("check")
    if section is None:
        if role is not None:
            raise bad(CHECK_SECTION, f"missing, but files_by_role names a check file ({role!r})")
        return
    if section.get("file") != role or role is None:
        raise bad(f"{CHECK_SECTION}.file", f"{section.get('file')!r} is not files_by_role's check file ({role!r})")
    if section.get("source") not in CHECK_SOURCES:
        raise bad(f"{CHECK_SECTION}.source", f"{section.get('source')!r} is not one of {', '.join(CHECK_SOURCES)}")
    count, generated = section.get("images"), section.get("generated")
    if not (_integer(count) and 0 < count <= MAX_CHECK_IMAGES):
        raise bad(f"{CHECK_SECTION}.images", f"not a count of 1 to {MAX_CHECK_IMAGES} images, got {count!r}")
    if not (_integer(generated) and 0 <= generated <= count):
        raise bad(f"{CHECK_SECTION}.generated", f"not a count of 0 to {count} images, got {generated!r}")


def _check_artifact(m: dict[str, Any], bad: Any, name: str, fmt: str) -> None:
    """A model artifact's section (``torchscript``, ``torchscript_training``, ``executorch``) and role come together; its file is the
    role's, its format ``fmt``, its LoRA inputs the bundle's."""
    section, role = m.get(name), m["files_by_role"].get(name)
    if section is None:
        if role is not None:
            raise bad(name, f"missing, but files_by_role names a {name} file ({role!r})")
        return
    if role is None or section.get("file") != role:
        raise bad(f"{name}.file", f"{section.get('file')!r} is not files_by_role's {name} file ({role!r})")
    if section.get("format") != fmt:
        raise bad(f"{name}.format", f"{section.get('format')!r} is not {fmt!r}")
    lora = section.get("lora_inputs")
    if not isinstance(lora, list) or sorted(lora) != sorted(m["lora"].get("tensors") or {}):
        raise bad(f"{name}.lora_inputs", "must list the bundle's LoRA tensors (lora.tensors)")


def file_entries(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """{name: {sha256, bytes}} for files in ``directory`` (the manifest's ``files``)."""
    return {name: {"sha256": sha256_file(directory / name), "bytes": (directory / name).stat().st_size}
            for name in sorted(names)}


def classes_digest(names: list[str]) -> str:
    """sha256 of a class list in logit order (canonical JSON): what model.onnx's metadata pins."""
    return hashlib.sha256(json.dumps(list(names), ensure_ascii=False, separators=(",", ":")).encode("utf-8")
                          ).hexdigest()


def manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    """Canonical manifest text: sorted keys, two-space indent, trailing newline."""
    from fedmvp_formats.strict_json import dumps

    return (dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def write_manifest(directory: Path, manifest: Mapping[str, Any]) -> Path:
    """Write manifest.json atomically (a reader never sees a half-written manifest)."""
    return write_bytes(Path(directory) / MANIFEST, manifest_bytes(manifest))
