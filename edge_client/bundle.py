"""The edge bundle format: a directory with a manifest that hashes every file.

```
bundle/
  manifest.json        format + version, source run and round, model, classes, preprocessing,
                       precision, method config, files (sha256 + bytes), LoRA names and shapes, parity,
                       promptformer (digest, copy map, derivation: what a refresh needs)
  model.onnx           pixel_values -> logits, probs, image_embeds (fp32: weights external,
                       in weights.safetensors)
  weights.safetensors  every frozen tensor by name (the ONNX model's and the training program's)
  lora.safetensors     the LoRA tensors (lora.block.attn.to_{q,k,v}.lora_{A,B}.weight)
  train.pt2            torch.export training program (no tensors of its own)
  text_features.safetensors  text.attribute_features [C*K, E]: what the PromptFormer's text_proj
                       receives, so a refresh can recompute the baked text side (trainable bundles)
  check_images.safetensors   images [N, S, S, 3] uint8: the pictures `--runtime auto` verifies runtimes on
                       (``edge_client.check_images``; absent in bundles exported before)
  previous/            after a refresh: the files it replaced (and the old personalised/), for rollback
```
The manifest's ``method`` is the model's method configuration (num_prompts, heads, ff_mult,
alpha, flip_prob, lora_rank, lora_targets, use_lora; docs/method.md §3-§5): local training
takes its loss weight alpha from there. A bundle's identity (`Bundle.id`, what update files
and the personalisation state are tied to) is the sha256 of its manifest.json, which lists
every file's sha256.
The manifest's ``promptformer`` section (docs/method.md §10) says which global PromptFormer the
bundle holds and how to move it to another one in place (``edge_client.refresh``)::

    "promptformer": {"digest": "<promptformer_digest of the round's promptformer.* tensors>",
                     "copy": {"promptformer.block.attn.to_q.weight": "prompt.to_q.weight", ...},
                     "derive": "fedmvp-context-v1", "norm_context_eps": 1e-05}

``copy`` maps every query-side run tensor to the weights tensor it is stored as; ``derive``
names how the text constants (``text.key_context``, ``text.value_context``, ``text.key_base``,
``text.value_base``) follow from the rest and ``text.attribute_features``. ``source`` records
``run_id`` (None for runs that had none) and, after a refresh, ``refreshed_from`` (the bundle id
before it). Both are optional within format 2: a bundle without them cannot be refreshed.
An inference-only bundle (``fedmvp-export --inference-only``) has no train.pt2 and no
text_features.safetensors, and no weights.safetensors either when its ONNX model embeds its
weights (fp16, int8).
The format (its name and version, sections and their types, file names, the refresh's names) is
``fedmvp_formats.bundle_manifest``, which the exporter writes by too.
manifest.json itself is hashed by nothing, so `read_bundle` checks (``check_manifest``, the one the
exporter holds its own manifest to) that its sections have their types and agree with each other
(``classes.names`` unique strings, as many as ``classes.count`` and the model's
``onnx.num_classes`` outputs; ``method`` a valid method record), and that the class list is the one the ONNX model
was exported with: model.onnx (which the manifest hashes) carries the class list's sha256 in its
metadata (``fedmvp.classes_sha256``, `classes_digest`), so relabelled classes are refused.
Only numpy, safetensors and the standard library are used here: the smallest install can
read and verify a bundle. ``read_bundle`` verifies every hash before anything is loaded, then checks
every file a library will parse as an attacker who also wrote the manifest could have shaped it
(``edge_client.bundle_files``: names, links, the ONNX model's external data, the training program's
archive, which ``torch.export.load`` would unpickle from; ``edge_client.safetensors_check``: the
safetensors headers), so none of it reaches onnxruntime, safetensors or torch unchecked.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedmvp_formats.bundle_manifest import (CHECK_SECTION, CLASSES_KEY, MANIFEST, REFRESH_DERIVE, REFRESH_JOURNAL,
                                            ManifestError, check_manifest, classes_digest)
from fedmvp_formats.files import sha256_file
from fedmvp_formats.method import MethodRecord
from fedmvp_formats.privacy import RECORD as PRIVACY
from fedmvp_formats.privacy import PrivacyError, PrivacyRecord

# BundleError and verify_program_archive are the bundle format's: the rest of the package imports them from here.
from edge_client.bundle_files import (BundleError, check_device_dirs, check_onnx_external,  # noqa: F401
                                      file_problem, plain_name, verify_program_archive)
from edge_client.bundle_files import fail as _fail
from edge_client.check_images import CheckImages, check_header, generated_check_images, read_check_images
from edge_client.preprocess import PreprocessSpec
from edge_client.safetensors_check import check_safetensors, load_safetensors

DEFAULT_BUNDLE = "bundle"  # where no bundle directory is given


@dataclass(frozen=True)
class ChosenBundleDir:
    """A bundle directory the caller chose by its own default rule, not one the user named: ``looked``
    says where it looked, for the line when it is not there (`edge-client` without --bundle:
    ``$FEDMVP_BUNDLE``, then ./bundle; the app reads the environment, the library never does)."""

    path: Path
    looked: str

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)


@dataclass
class Bundle:
    """A verified bundle directory."""

    path: Path
    manifest: dict[str, Any]

    @staticmethod
    def resolve_dir(bundle: str | os.PathLike | None = None) -> Path:
        """``bundle`` if given, else ``./bundle``."""
        if isinstance(bundle, ChosenBundleDir):
            return bundle.path
        if bundle is not None and str(bundle) != "":
            return Path(bundle)
        return Path(DEFAULT_BUNDLE)

    @classmethod
    def open(cls, bundle: str | os.PathLike | Bundle | None = None, verify: bool = True) -> Bundle:
        """A `Bundle` as given, or read (and by default verified) from `resolve_dir(bundle)`."""
        if isinstance(bundle, Bundle):
            return bundle
        path = cls.resolve_dir(bundle)
        if not path.is_dir():
            raise BundleError(not_found(bundle, path))
        return read_bundle(path, verify=verify)

    @property
    def id(self) -> str:
        """sha256 of manifest.json: the manifest lists every file's sha256, so this pins all of them."""
        return sha256_file(Path(self.path) / MANIFEST)

    @property
    def round(self) -> int | None:
        """The federated round the bundle was exported from (``source.round``), if recorded."""
        value = (self.manifest.get("source") or {}).get("round")
        return value if isinstance(value, int) else None

    @property
    def base_digest(self) -> str | None:
        """The state of the round the bundle's weights are (``source.base_digest``: its PromptFormer and global
        LoRA, ``fedmvp_formats.promptformer.base_digest``), if recorded: an update trained on it names it."""
        value = (self.manifest.get("source") or {}).get("base_digest")
        return value if isinstance(value, str) else None

    @property
    def run_id(self) -> str | None:
        """The run the bundle was exported from (``source.run_id``), if the exporter recorded it."""
        value = (self.manifest.get("source") or {}).get("run_id")
        return value if isinstance(value, str) and value else None

    @property
    def privacy(self) -> PrivacyRecord | None:
        """The run's ``[privacy]`` settings the exporter recorded (manifest ``privacy``; None: none): what
        `edge-client train` clips, and in local mode noises, its delta by (docs/howto/privacy.md)."""
        record = self.manifest.get(PRIVACY)
        if record is None:
            return None
        try:
            return PrivacyRecord.from_record(record, f"{self.path / MANIFEST}: field {PRIVACY}")
        except PrivacyError as err:
            raise BundleError(str(err)) from None

    @property
    def method(self) -> dict[str, Any]:
        """The model's method record (docs/method.md §3-§5), migrated to this release's version
        (``fedmvp_formats.method``); ``read_bundle`` checked it."""
        return MethodRecord.from_dict(self.manifest["method"], f"{self.path / MANIFEST}: field method").to_dict()

    def file(self, role: str) -> Path:
        """Path of the file with ``role`` (onnx, weights, lora, training, text)."""
        name = self.manifest.get("files_by_role", {}).get(role)
        if name is None:
            raise BundleError(f"{self.path}: the manifest names no {role} file")
        return self.path / name

    @property
    def trainable(self) -> bool:
        """Whether the bundle carries what `edge-client train` needs (not exported --inference-only)."""
        roles = self.manifest.get("files_by_role", {})
        return "training" in roles and "weights" in roles

    @property
    def classes_digest(self) -> str | None:
        """The class-set digest of the names and phrases baked in (``classes.digest``,
        ``fedmvp_formats.class_set``), if recorded: what a federation's messages are compared with."""
        value = self.manifest["classes"].get("digest") if isinstance(self.manifest.get("classes"), dict) else None
        return value if isinstance(value, str) else None

    @property
    def promptformer_digest(self) -> str | None:
        """Digest of the global PromptFormer the bundle holds (``promptformer.digest``), if recorded."""
        section = self.manifest.get("promptformer")
        value = section.get("digest") if isinstance(section, dict) else None
        return value if isinstance(value, str) else None

    def refresh_blocker(self) -> str | None:
        """Why the bundle cannot be refreshed in place (docs/method.md §10); None when it can."""
        section = self.manifest.get("promptformer")
        if not self.trainable:
            return "exported for inference only: no attribute features to recompute from; re-export the round"
        precision = self.manifest.get("precision")
        if precision != "fp32":
            return (f"a {precision} bundle embeds its weights in the ONNX model, only fp32 bundles can be "
                    f"refreshed in place; re-export the round")
        if "text" not in self.manifest.get("files_by_role", {}) or not isinstance(section, dict) \
                or "copy" not in section:
            return "exported before refresh support; re-export the round"
        if section.get("derive") != REFRESH_DERIVE:
            return f"its text side derives as {section.get('derive')!r}, unknown to this edge-client; update it"
        return None

    @property
    def refreshable(self) -> bool:
        """Whether `edge_client.refresh.refresh_bundle` can move this bundle to another PromptFormer."""
        return self.refresh_blocker() is None

    def require_refreshable(self) -> None:
        """Refuse (one line, what to do) a bundle that cannot be refreshed in place."""
        reason = self.refresh_blocker()
        if reason is not None:
            raise BundleError(f"{self.path}: {reason}")

    def require_trainable(self) -> None:
        """Refuse (one line, what to do) a bundle exported for inference only."""
        if not self.trainable:
            raise BundleError(f"{self.path}: exported for inference only (fedmvp-export --inference-only): "
                              f"no training program to train with; re-export the round without that flag")

    @property
    def class_names(self) -> list[str]:
        """Class names in logit order."""
        return list(self.manifest["classes"]["names"])

    @property
    def preprocess(self) -> PreprocessSpec:
        """How images become the model's input (the data the manifest carries instead of open_clip)."""
        return PreprocessSpec.from_manifest(self.manifest["preprocess"])

    @property
    def precision(self) -> str:
        """fp32, fp16 or int8: what the ONNX model computes in."""
        return str(self.manifest["precision"])

    @property
    def lora_shapes(self) -> dict[str, list[int]]:
        """LoRA tensor name -> shape, as the manifest records them (what updates must match)."""
        return {k: list(v) for k, v in self.manifest["lora"]["tensors"].items()}

    def check_images(self) -> CheckImages:
        """The pictures `--runtime auto` verifies on: the shipped ones (manifest ``check_images``), else, in a
        bundle exported before they travelled, colour fields drawn from its id (``edge_client.check_images``)."""
        section = self.manifest.get(CHECK_SECTION)
        if section is None:
            return CheckImages(generated_check_images(self.id, self.preprocess), "bundle-id")
        pixels = read_check_images(self.file("check"), self.preprocess, section["images"])
        return CheckImages(pixels, section["source"], self.manifest["files"][section["file"]]["sha256"])

    def lora(self) -> dict[str, Any]:
        """The LoRA tensors as numpy arrays (no torch needed), the file's header checked first."""
        return load_safetensors(self.file("lora"))


def not_found(given: str | os.PathLike | None, path: Path) -> str:
    """The one line for a bundle directory that is not there: where it looked and what to type.

    Why: after `fedmvp-export` a user types `edge-client infer img.jpg`; "not a bundle directory"
    alone does not say that ./bundle was the default, nor how to make one."""
    what = "a file, " if path.is_file() else ""
    if isinstance(given, ChosenBundleDir):
        looked = given.looked
    elif given is not None and str(given) != "":
        return f"{path}: not a bundle directory ({what}given with --bundle)"
    else:
        looked = f"./{DEFAULT_BUNDLE}"
    return (f"{path}: not a bundle directory ({what}no bundle found; looked at {looked}); export one with "
            f"`fedmvp-export --round N` (it points ./{DEFAULT_BUNDLE} at it) or pass --bundle DIR")


def read_bundle(directory: str | os.PathLike, verify: bool = True) -> Bundle:
    """Read manifest.json and (by default) verify every listed file's size and sha256."""
    root = Path(directory)
    try:
        return _read(root, verify)
    except BundleError as err:
        if (root / REFRESH_JOURNAL).exists():  # say why, and what finishes it
            raise BundleError(f"{err} (a bundle refresh was interrupted: edge_client.refresh.recover_refresh "
                              f"completes it)") from None
        raise


def _read(root: Path, verify: bool) -> Bundle:
    """`read_bundle` without the hint about an interrupted refresh."""
    manifest_path = root / MANIFEST
    if not root.is_dir():
        raise _fail(root, "not a bundle directory")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _fail(manifest_path, "missing (not a fedmvp bundle)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise _fail(manifest_path, f"corrupt JSON ({err})") from None
    try:
        check_manifest(manifest, str(manifest_path))
    except ManifestError as err:
        raise BundleError(str(err)) from None
    try:
        PreprocessSpec.from_manifest(manifest["preprocess"])
    except (KeyError, TypeError, ValueError) as err:
        raise _fail(manifest_path, f"field preprocess: {' '.join(str(err).split())}") from None
    check_device_dirs(root)
    _check_files(root, manifest_path, manifest["files"], verify)
    if verify:
        _check_class_pin(root, manifest_path, manifest)
        _check_contents(root, manifest)
    return Bundle(path=root, manifest=manifest)


def onnx_classes_pin(path: Path) -> str | None:
    """The class-list digest model.onnx was exported with (its ``fedmvp.classes_sha256``), or None."""
    from edge_client.protobuf import onnx_metadata

    try:
        return onnx_metadata(path).get(CLASSES_KEY)
    except ValueError as err:
        raise _fail(path, f"not a readable ONNX model ({' '.join(str(err).split())[:200]})") from None


def _check_class_pin(root: Path, manifest_path: Path, m: dict[str, Any]) -> None:
    """Refuse a manifest whose class list is not the one the (hashed) ONNX model was exported with."""
    pinned = onnx_classes_pin(root / m["files_by_role"]["onnx"])
    if pinned is not None and pinned != classes_digest(m["classes"]["names"]):
        raise _fail(manifest_path, f"field classes.names: not the class list model.onnx was exported with "
                                   f"({CLASSES_KEY}); the manifest was edited, predictions would be "
                                   f"mislabelled: re-export the bundle")


def _check_files(root: Path, manifest_path: Path, files: dict[str, Any], verify: bool) -> None:
    """Every listed file is a regular file inside the bundle, not a link, and (with ``verify``) of its size
    and sha256."""
    for name, entry in sorted(files.items()):
        if not plain_name(name):
            raise _fail(manifest_path, f"file name {name!r} leaves the bundle directory (a bundle lists plain "
                                       f"file names only)")
        path = root / name
        problem = file_problem(path)
        if problem:
            raise _fail(path, problem)
        if not verify:
            continue
        size = path.stat().st_size
        if size != entry.get("bytes"):
            raise _fail(path, f"size {size} != {entry.get('bytes')} in the manifest (file changed or truncated)")
        if sha256_file(path) != entry.get("sha256"):
            raise _fail(path, "sha256 does not match the manifest (file changed)")


def _check_contents(root: Path, m: dict[str, Any]) -> None:
    """What a library will parse, checked first: safetensors headers, the ONNX model's external data
    (listed files only), the training program's archive (nothing torch would unpickle)."""
    files, roles = m["files"], m["files_by_role"]
    tensors = {n for n in files if n.endswith(".safetensors")} | {roles[r] for r in ("weights", "lora", "text")
                                                                   if r in roles}
    for name in sorted(tensors - {roles.get("check")}):
        check_safetensors(root / name)
    if "check" in roles:  # uint8 pictures, not float32 tensors
        check_header(root / roles["check"], PreprocessSpec.from_manifest(m["preprocess"]).image_size,
                     m[CHECK_SECTION]["images"])
    check_onnx_external(root / roles["onnx"], {n: e.get("bytes") for n, e in files.items()})
    if "training" in roles:
        verify_program_archive(root / roles["training"])
