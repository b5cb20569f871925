"""Refresh a bundle in place to a newer global PromptFormer (and LoRA); keep the old one for rollback.

Why: the federation keeps changing the global PromptFormer, and a LoRA trained over an older
one is not the same function. A device whose bundle's ``promptformer.digest`` differs from the
round's receives the round's ``promptformer.*`` (and global ``lora.*``) tensors and calls
`refresh_bundle`: the query-side tensors are copied into ``weights.safetensors`` as the
manifest's ``copy`` map says, the text constants the exporter baked in are derived again from
``text_features.safetensors`` (docs/method.md §10), and every tensor is overwritten at its
existing offset, so the fp32 ONNX model (which reads its weights there as external data) and
the training program both see the new values; a new LoRA is also written into the embedded
initializers of model.onnx. Before anything is committed, ONNX Runtime and the training program
must agree on the new model. The replaced files and the device's ``personalised/`` LoRAs (trained
over the old PromptFormer) go to ``previous/``; `restore_previous` (``edge-client rollback
--refresh``) brings them back. Every change is staged and then committed by journaled renames
(``edge_client.journal``): `recover_refresh` completes one a crash interrupted. A refresh and its
rollback hold the bundle's lock (``edge_client.bundle_lock``): never under a running train.

numpy, safetensors and the standard library; torch only for the parity check (lazily).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedmvp_formats.atomic import copy_file, copy_patched
from fedmvp_formats.bundle_manifest import (CONTEXT_LAYERS, MANIFEST, PERSONALISED, PREVIOUS, REFRESH_DISCARD,
                                            REFRESH_NEW, REFRESH_PREVIOUS, TEXT_CONSTANTS, TEXT_FEATURES,
                                            file_entries, write_manifest)
from fedmvp_formats.files import sha256_file
from fedmvp_formats.names import LORA_PREFIX, PROMPTFORMER_PREFIX
from fedmvp_formats.promptformer import base_digest, promptformer_digest
from fedmvp_formats.tensors import tensor_problem

from edge_client import journal
from edge_client.bundle import Bundle, BundleError, read_bundle
from edge_client.bundle_files import check_device_dirs, file_problem, plain_name
from edge_client.bundle_lock import BundleBusy, bundle_lock
from edge_client.lora_store import personalisation_lock
from edge_client.refresh_check import check_refreshed
from edge_client.safetensors_check import load_safetensors
from edge_client.tensor_layout import Span, onnx_initializer_spans, safetensors_layout


class NoPreviousBundle(BundleError):
    """There is no refresh to roll back (no ``previous/``)."""


@dataclass
class RefreshResult:
    """What `refresh_bundle` did: bundle ids before and after, the round, the cost and the check."""

    old_id: str
    new_id: str
    round: int
    bytes_received: int
    seconds: float
    parity_max_abs_diff: float | None
    images_checked: int

    def to_json(self) -> dict[str, Any]:
        return {"old_id": self.old_id, "new_id": self.new_id, "round": self.round,
                "bytes_received": self.bytes_received, "seconds": round(self.seconds, 3),
                "parity_max_abs_diff": self.parity_max_abs_diff, "images_checked": self.images_checked}


def derive_text(features: np.ndarray, tensors: Mapping[str, np.ndarray], eps: float) -> dict[str, np.ndarray]:
    """The four text constants from the attribute features and the PromptFormer (docs/method.md §10).

    float64 arithmetic, float32 results: value = text_proj(F), key = LayerNorm_ctx(value),
    key_base = to_k(key), value_base = to_v(value)."""
    def w(layer: str, leaf: str) -> np.ndarray:
        return np.asarray(tensors[f"{CONTEXT_LAYERS[layer]}.{leaf}"], dtype=np.float64)

    value = np.asarray(features, np.float64) @ w("text_proj", "weight").T + w("text_proj", "bias")
    centred = value - value.mean(axis=-1, keepdims=True)
    key = centred / np.sqrt((centred ** 2).mean(axis=-1, keepdims=True) + eps)
    key = key * w("norm_context", "weight") + w("norm_context", "bias")
    out = {"text.key_context": key, "text.value_context": value,
           "text.key_base": key @ w("to_k", "weight").T + w("to_k", "bias"),
           "text.value_base": value @ w("to_v", "weight").T + w("to_v", "bias")}
    return {name: np.ascontiguousarray(array, dtype=np.float32) for name, array in out.items()}


def recover_refresh(bundle_dir: str | Path, break_lock: bool = False) -> str | None:
    """Complete a refresh or rollback a crash interrupted ("refresh" / "restore"); None if there was none.

    Call it when the device starts: afterwards the bundle verifies as either the old or the new one.
    A bundle whose lock is held is left alone (None): its holder is alive and finishes its own change
    (recovering under it would delete the files it is staging). A lock whose record names another host
    raises `BundleBusy` (that holder cannot be checked from here) unless ``break_lock``."""
    try:
        with bundle_lock(bundle_dir, break_lock=break_lock):
            return journal.recover(Path(bundle_dir))
    except BundleBusy as busy:
        if busy.elsewhere:
            raise
        return None


def refresh_bundle(bundle: Bundle, tensors: Mapping[str, np.ndarray], *, digest: str, round_number: int,
                   check_images: Sequence[Path] = (), run_id: str | None = None) -> RefreshResult:
    """Move ``bundle`` in place to the PromptFormer (and, if given, the global LoRA) in ``tensors``.

    ``digest``: what the server announced for these tensors (`promptformer_digest`). Anything
    refused (a bundle that cannot be refreshed, tensors that are not what the server said, wrong
    names or shapes, non-finite values, a failed parity check on up to 4 ``check_images``) raises
    `BundleError` with the bundle as it was; `BundleBusy` when another process holds the bundle's
    lock (a train, a rollback). ``bundle`` describes the old bundle afterwards:
    ``read_bundle(bundle.path)`` reads the refreshed one (id ``RefreshResult.new_id``). ``run_id``: the run
    the tensors come from (a federation's message): the manifest's ``source`` names it and ``round_number``
    with the new weights, in the same commit, so update files trained on them name where they came from."""
    with bundle_lock(bundle.path):
        return _refresh_locked(Path(bundle.path), tensors, digest, round_number, check_images, run_id)


def _refresh_locked(root: Path, tensors: Mapping[str, np.ndarray], digest: str, round_number: int,
                    check_images: Sequence[Path], run_id: str | None = None) -> RefreshResult:
    """`refresh_bundle` with the bundle's lock held."""
    began = time.perf_counter()
    journal.recover(root)
    bundle = read_bundle(root)  # verified: a tampered weights file is never patched into a "new" bundle
    bundle.require_refreshable()
    if not isinstance(round_number, int) or isinstance(round_number, bool) or round_number < 0:
        raise BundleError(f"{root}: round_number must be a non-negative int, got {round_number!r}")
    arrays = {str(k): np.asarray(v) for k, v in tensors.items()}
    got = promptformer_digest(_checked_numbers(root, arrays))
    if got != digest:
        raise BundleError(f"{root}: the PromptFormer tensors received hash to {got[:16]}, not to the announced "
                          f"digest {str(digest)[:16]}; refused, the bundle is unchanged")
    promptformer, lora = _checked_tensors(bundle, arrays)
    section = bundle.manifest["promptformer"]
    weights = _weights_patches(bundle, promptformer, section)
    old_id = bundle.id
    names = bundle.manifest["files_by_role"]
    changed = [names["weights"]] + ([names["lora"], names["onnx"]] if lora else [])
    journal.start_scratch(root)
    try:
        staged = root / REFRESH_NEW
        copy_patched(bundle.file("weights"), staged / names["weights"], weights)
        if lora:
            copy_patched(bundle.file("lora"), staged / names["lora"], _patches(
                safetensors_layout(bundle.file("lora")), lora, bundle.file("lora")))
            copy_patched(bundle.file("onnx"), staged / names["onnx"], _patches(
                onnx_initializer_spans(bundle.file("onnx")), lora, bundle.file("onnx")))
        else:
            copy_file(bundle.file("onnx"), staged / names["onnx"])  # beside the new weights, for the check
            copy_file(bundle.file("lora"), root / REFRESH_PREVIOUS / names["lora"])  # previous/ is whole
        diff, checked = check_refreshed(bundle, staged / names["onnx"], staged / names["weights"],
                                        lora or bundle.lora(), check_images)
        manifest = _refreshed_manifest(bundle, staged, changed, digest, round_number, old_id, run_id,
                                       base_digest(digest, lora) if lora else None)
        write_manifest(staged, manifest)
        new_id = sha256_file(staged / MANIFEST)
    except OSError as err:  # a full disk, say: nothing the bundle lists has changed
        journal.clean_scratch(root)
        raise BundleError(f"{root}: cannot stage the refresh ({_one_line(err)}); the bundle is "
                          f"unchanged") from None
    except BaseException:
        journal.clean_scratch(root)
        raise
    moves = [step for name in changed for step in _replace(name)] + [
        (PERSONALISED, f"{REFRESH_PREVIOUS}/{PERSONALISED}"), *_replace(MANIFEST),
        (PREVIOUS, f"{REFRESH_DISCARD}/{PREVIOUS}"), (REFRESH_PREVIOUS, PREVIOUS)]
    _commit(root, "refresh", moves, {"bundle_before": old_id, "bundle_after": new_id})
    return RefreshResult(old_id=old_id, new_id=new_id, round=round_number,
                         bytes_received=sum(int(a.nbytes) for a in arrays.values()),
                         seconds=time.perf_counter() - began, parity_max_abs_diff=diff, images_checked=checked)


def _replace(name: str) -> list[tuple[str, str]]:
    """The two renames that swap a staged file in and keep the old one for previous/."""
    return [(name, f"{REFRESH_PREVIOUS}/{name}"), (f"{REFRESH_NEW}/{name}", name)]


def restore_previous(bundle_dir: str | Path, wait: float = 0.0, break_lock: bool = False) -> Bundle:
    """Undo the last refresh: the previous files and personalisation come back, the refreshed ones go.
    Under the bundle's lock (``wait``: seconds to wait for another holder, else `BundleBusy`)."""
    with bundle_lock(bundle_dir, wait, break_lock=break_lock):
        return _restore_locked(Path(bundle_dir))


def _restore_locked(root: Path) -> Bundle:
    """`restore_previous` with the bundle's lock held."""
    check_device_dirs(root)  # previous/ is no link out of the bundle: what it holds is moved in
    journal.recover(root)
    previous = root / PREVIOUS
    try:
        manifest = json.loads((previous / MANIFEST).read_text(encoding="utf-8"))
        files = dict(manifest["files"])
    except FileNotFoundError:
        raise NoPreviousBundle(f"{root}: nothing to roll back (no refresh kept a previous bundle)") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise BundleError(f"{previous / MANIFEST}: unreadable ({_one_line(err)})") from None
    strays = sorted(repr(name) for name in files if not plain_name(name))
    if strays:
        raise BundleError(f"{previous / MANIFEST}: file name {strays[0]} leaves the bundle directory; cannot roll "
                          f"back the refresh")
    kept = sorted(name for name in files if (previous / name).is_file())
    for name, entry in sorted(files.items()):  # the bundle it restores must verify, before anything moves
        path = previous / name if name in kept else root / name
        if not _matches(path, entry):
            raise BundleError(f"{path}: does not match {previous / MANIFEST}; cannot roll back the refresh")
    journal.start_scratch(root)
    moves = [step for name in [*kept, PERSONALISED, MANIFEST] for step in
             ((name, f"{REFRESH_DISCARD}/{name}"), (f"{PREVIOUS}/{name}", name))]
    _commit(root, "restore", moves + [(PREVIOUS, f"{REFRESH_DISCARD}/{PREVIOUS}")], {})
    return read_bundle(root)


def _commit(root: Path, kind: str, moves: list[tuple[str, str]], record: dict[str, Any]) -> None:
    """`journal.commit` under the personalisation lock (it moves personalised/: an apply or rollback
    must not write into it meanwhile), with a failed rename reported as one line."""
    try:
        with personalisation_lock(root):
            journal.commit(root, kind, moves, record)
    except OSError as err:
        raise BundleError(f"{root}: the {kind} stopped part-way ({_one_line(err)}); "
                          f"edge_client.refresh.recover_refresh completes it") from None


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:300]


def _matches(path: Path, entry: Any) -> bool:
    """Whether ``path`` is a file of the size and sha256 a manifest entry records."""
    if file_problem(path) or not isinstance(entry, dict) or path.stat().st_size != entry.get("bytes"):
        return False
    return file_entries(path.parent, [path.name])[path.name]["sha256"] == entry.get("sha256")


# ---- checks and patches ------------------------------------------------------------------------
def _checked_numbers(root: Path, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Refuse tensors that are not real numbers (before hashing them as float32)."""
    for name, value in sorted(arrays.items()):
        if value.dtype.kind != "f":
            raise BundleError(f"{root}: tensor {name} is {value.dtype}, not a float tensor; refused")
    return arrays


def _checked_tensors(bundle: Bundle, arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray],
                                                                              dict[str, np.ndarray]]:
    """(PromptFormer, LoRA) tensors as float32, after checking names, shapes and values against the bundle."""
    root = bundle.path
    copy = bundle.manifest["promptformer"]["copy"]
    layout = safetensors_layout(bundle.file("weights"))
    features = safetensors_layout(bundle.file("text")).get(TEXT_FEATURES)
    absent = sorted({*copy.values(), *TEXT_CONSTANTS} - set(layout))
    if features is None or len(features.shape) != 2 or absent:
        lacking = ", ".join(absent[:3]) or TEXT_FEATURES
        raise BundleError(f"{root}: the bundle lacks what a refresh rewrites ({lacking}); re-export the round")
    width, embed = layout["text.key_context"].shape[1], features.shape[1]
    expected = {source: list(layout[target].shape) for source, target in copy.items()}
    for layer, name in CONTEXT_LAYERS.items():
        expected[f"{name}.weight"] = [width, embed] if layer == "text_proj" else \
            ([width] if layer == "norm_context" else [width, width])
        expected[f"{name}.bias"] = [width]
    promptformer = {k: v for k, v in arrays.items() if k.startswith(PROMPTFORMER_PREFIX)}
    lora = {k: v for k, v in arrays.items() if k.startswith(LORA_PREFIX)}
    stray = sorted(set(arrays) - set(promptformer) - set(lora))
    missing, extra = sorted(set(expected) - set(promptformer)), sorted(set(promptformer) - set(expected))
    problems = [f"unexpected tensors {', '.join(stray[:4])}" if stray else "",
                f"missing {', '.join(missing[:4])}" if missing else "",
                f"unknown PromptFormer tensors {', '.join(extra[:4])}" if extra else ""]
    if any(problems):
        raise BundleError(f"{root}: refused: {'; '.join(p for p in problems if p)}")
    shapes = {**expected, **(bundle.lora_shapes if lora else {})}
    if lora and set(lora) != set(bundle.lora_shapes):
        raise BundleError(f"{root}: refused: the LoRA tensors are not the bundle's "
                          f"({', '.join(sorted(set(lora) ^ set(bundle.lora_shapes))[:4])})")
    problem = tensor_problem({**promptformer, **lora}, shapes, of="the bundle", dtype=None)  # the one check
    if problem is not None:
        raise BundleError(f"{root}: refused: {problem}")
    as32 = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in arrays.items()}
    return {k: as32[k] for k in promptformer}, {k: as32[k] for k in lora}


def _weights_patches(bundle: Bundle, promptformer: dict[str, np.ndarray], section: dict[str, Any]) -> dict[int, bytes]:
    """{offset: bytes} for weights.safetensors: the copied query side and the derived text constants."""
    features = load_safetensors(bundle.file("text"))[TEXT_FEATURES]
    new = {target: promptformer[source] for source, target in section["copy"].items()}
    new.update(derive_text(features, promptformer, float(section["norm_context_eps"])))
    return _patches(safetensors_layout(bundle.file("weights")), new, bundle.file("weights"))


def _patches(layout: dict[str, Span], tensors: Mapping[str, np.ndarray], path: Path) -> dict[int, bytes]:
    """{offset: float32 LE bytes} for each tensor, which must be stored in ``path`` as F32 of its shape."""
    out = {}
    for name, value in sorted(tensors.items()):
        span = layout.get(name)
        data = np.ascontiguousarray(value, dtype="<f4").tobytes()
        if span is None or span.dtype != "F32" or list(span.shape) != list(value.shape) or span.length != len(data):
            raise BundleError(f"{path}: holds no F32 tensor {name} of shape {list(value.shape)} to refresh in place")
        out[span.offset] = data
    return out


def _refreshed_manifest(bundle: Bundle, staged: Path, changed: list[str], digest: str, round_number: int,
                        old_id: str, run_id: str | None = None, base: str | None = None) -> dict[str, Any]:
    """The old manifest with the new files' hashes, the run and round its weights now come from, where
    the bundle was refreshed from (docs/architecture.md "Records that travel", bundle identity) and the
    round's state ``base`` (None: the message brought no LoRA, so the bundle holds no round's state)."""
    manifest = json.loads(json.dumps(bundle.manifest))
    manifest["files"].update(file_entries(staged, changed))
    # The checkpoint file the bundle was exported from no longer describes its tensors.
    manifest["source"] = {**(manifest.get("source") or {}), "round": int(round_number), "refreshed_from": old_id,
                          "checkpoint_sha256": None, "base_digest": base}
    if run_id is not None and run_id != bundle.run_id:  # joined another run: the weights are that run's now
        manifest["source"] |= {"run_id": run_id, "refreshed_from_run": bundle.run_id}
    manifest["promptformer"]["digest"] = digest
    return manifest
