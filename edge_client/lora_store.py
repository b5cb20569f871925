"""Personalisation: which LoRA the device's own inference runs, and rollback.

The exported bundle is never modified: its manifest keeps hashing exactly the files
``fedmvp-export`` wrote, so ``read_bundle`` keeps verifying it. Personalisation lives in a
sub-directory with its own small, verified state::

    bundle/personalised/
      state.json              which LoRA is active, its sha256, and the older ones (newest first)
      lora-0001.safetensors   update files, byte for byte as `edge-client train` wrote them (or, with no
                              update file kept, as it would have: `apply_update_bytes`)
      lora-0002.safetensors

``state.json``::

    {"format": "fedmvp-edge-personalisation", "format_version": 1,
     "bundle_id": "<Bundle.id>",                        # personalisation of THIS bundle only
     "active": {"file": "lora-0002.safetensors", "sha256": "...", "bytes": 25512,
                "applied": "2025-...Z", "update": {"mean_loss": ..., "num_examples": ..., ...}}
               | null,                                  # null: the bundle's own LoRA
     "history": [{...lora-0001...}],                    # what `rollback` goes back to, newest first
     "next": 3}

Applying LoRA to the ONNX model: the exporter keeps the LoRA tensors as named, overridable
initializers, so the session is created with the active tensors in place of the stored
ones (ORT ``SessionOptions.add_initializer``): identical to rewriting the initializers in
the file, without copying the model (hundreds of MB for fp16/int8) and without touching any
hashed file. The active file's sha256 (and the update's bundle id, names and shapes) are
verified every time it is loaded; a mismatch refuses to run, like a tampered bundle.

Every read-modify-write of ``state.json`` (apply, rollback) and a refresh's moves of
``personalised/`` hold an exclusive lock (``fcntl.flock`` on the bundle directory itself,
`personalisation_lock`): two processes personalising one bundle never lose an update or reuse a
file number. The lock is on the bundle directory, not in ``personalised/``, because a refresh
moves that directory, and not on a lock file, so that the bundle's tree stays exactly what the
exporter and a refresh wrote.

Commit points are single renames (``fedmvp_formats.atomic``): a LoRA file is written under a
temp name (carrying the writer's pid) and renamed, then ``state.json`` is replaced. A crash in
between leaves an unreferenced file that the next change removes (temp files only when their
process is gone); the active LoRA is always either the old or the new one.
"""

from __future__ import annotations

import json
import os
import shutil
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedmvp_formats.atomic import copy_file, temp_is_removable, write_bytes
from fedmvp_formats.bundle_manifest import PERSONALISED
from fedmvp_formats.files import sha256_file
from fedmvp_formats.holder_lock import HolderLock
from fedmvp_formats.nofollow import UnsafePath, refuse_linked_dir

from edge_client.bundle import Bundle, BundleError
from edge_client.bundle_files import plain_name
from edge_client.update import Update, UpdateError, parse_update, read_update, update_bytes, utc_now

STATE = "state.json"
FORMAT = "fedmvp-edge-personalisation"
FORMAT_VERSION = 1
DEFAULT_KEEP = 5  # older LoRAs kept for rollback
_UPDATE_KEYS = ("bundle_round", "num_examples", "mean_loss", "final_loss", "epochs", "created", "train_seconds",
                "classes", "device")


class PersonalisationError(BundleError):
    """The personalisation state is corrupt, tampered with or belongs to another bundle."""


class NothingToRollBack(PersonalisationError):
    """The bundle already runs its own exported LoRA."""


@dataclass
class ActiveLora:
    """The LoRA the device runs: the bundle's own, or a personalised one."""

    tensors: dict[str, np.ndarray]
    source: str  # "bundle", "personalised" or "global" (a federation round's, given by the server)
    file: Path
    entry: dict[str, Any] = field(default_factory=dict)
    history: int = 0  # older personalised LoRAs kept for rollback
    round: int | None = None  # "global": the federation round whose state it is (an update names it as its base)

    @property
    def personalised(self) -> bool:
        """Whether this is a personalised LoRA (inference must override the stored initializers)."""
        return self.source == "personalised"

    def describe(self) -> str:
        """One line for people: which LoRA runs and what rollback would return to."""
        if not self.personalised:
            return "bundle LoRA (as exported)"
        update = self.entry.get("update", {})
        loss = update.get("mean_loss")
        bits = [f"personalised {self.file.name}"]
        if update.get("num_examples") is not None:
            bits.append(f"{update['num_examples']} images")
        if isinstance(loss, (int, float)):
            bits.append(f"mean loss {loss:.4f}")
        back = (f"{self.history} older kept for rollback" if self.history
                else "rollback returns to the bundle's LoRA")
        return ", ".join(bits) + f"; {back}"

    def to_json(self) -> dict[str, Any]:
        """The `--json` report of the active LoRA."""
        return {"source": self.source, "file": str(self.file), "history": self.history,
                **({"update": self.entry.get("update", {}), "applied": self.entry.get("applied")}
                   if self.personalised else {})}


def personalisation_lock(bundle_dir: str | os.PathLike) -> contextlib.AbstractContextManager:
    """Hold the bundle's personalisation lock (blocking) for one read-modify-write of its state: the
    project's lock without a record (``fedmvp_formats.holder_lock.HolderLock``, ``record=False``), an flock
    of the bundle directory itself, which writes nothing.

    Standard library only; where ``fcntl`` is missing (Windows) changes are not serialised."""
    return HolderLock(bundle_dir, "edge-client personalisation", record=False)


def state_dir(bundle: Bundle) -> Path:
    """Where the personalisation lives (beside the hashed files, never among them)."""
    return Path(bundle.path) / PERSONALISED


def _writable_state_dir(bundle: Bundle) -> Path:
    """`state_dir`, checked again under the lock before anything is written or deleted there: a link
    planted since the bundle was opened (a train lasts minutes) would take the writes outside the bundle."""
    try:
        return refuse_linked_dir(state_dir(bundle))
    except UnsafePath as err:
        raise PersonalisationError(str(err)) from None


def _empty_state(bundle: Bundle) -> dict[str, Any]:
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "bundle_id": bundle.id, "active": None,
            "history": [], "next": 1}


def read_state(bundle: Bundle) -> dict[str, Any] | None:
    """The parsed ``state.json`` (None when the bundle was never personalised)."""
    path = state_dir(bundle) / STATE
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PersonalisationError(f"{path}: unreadable ({err}); remove {path.parent} to return to the "
                                   f"bundle's LoRA") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise PersonalisationError(f"{path}: not a {FORMAT} state file")
    if state.get("format_version") != FORMAT_VERSION:
        raise PersonalisationError(f"{path}: state version {state.get('format_version')} is not supported")
    if state.get("bundle_id") != bundle.id:
        raise PersonalisationError(
            f"{path}: personalisation of another bundle ({str(state.get('bundle_id'))[:12]}), not of this one "
            f"({bundle.id[:12]}); run `edge-client rollback --all` or remove {path.parent}")
    if not isinstance(state.get("history"), list) or not isinstance(state.get("next"), int):
        raise PersonalisationError(f"{path}: malformed state (history/next)")
    entries = [("active", state.get("active"))] if state.get("active") is not None else []
    for where, entry in [*entries, *((f"history[{i}]", e) for i, e in enumerate(state["history"]))]:
        problem = _entry_problem(entry)
        if problem:
            raise PersonalisationError(f"{path}: malformed {where} entry ({problem}); `edge-client rollback --all` "
                                       f"returns to the bundle's LoRA")
    return state


def _entry_problem(entry: Any) -> str | None:
    """What is wrong with one state entry (None: file, sha256 and bytes have their types)."""
    if not isinstance(entry, dict):
        return f"not a mapping: {str(entry)[:40]!r}"
    name = entry.get("file")
    if not plain_name(name):
        return f"bad file name {name!r}"
    if not isinstance(entry.get("sha256"), str):
        return "no sha256"
    if not isinstance(entry.get("bytes"), int) or isinstance(entry.get("bytes"), bool):
        return "no byte count"
    if not isinstance(entry.get("update", {}), dict):
        return "update is not a mapping"
    return None


def _entry_path(bundle: Bundle, entry: dict[str, Any]) -> Path:
    name = str(entry.get("file", ""))
    if not plain_name(name):
        raise PersonalisationError(f"{state_dir(bundle) / STATE}: bad file name {name!r}")
    return state_dir(bundle) / name


def _load_entry(bundle: Bundle, entry: dict[str, Any]) -> dict[str, np.ndarray]:
    """Tensors of a state entry, after checking size, sha256, update metadata, names and shapes."""
    path = _entry_path(bundle, entry)
    if not path.is_file():
        raise PersonalisationError(f"{path}: active LoRA file is missing")
    if path.stat().st_size != entry.get("bytes") or sha256_file(path) != entry.get("sha256"):
        raise PersonalisationError(f"{path}: sha256 does not match {PERSONALISED}/{STATE} (file changed)")
    try:
        return read_update(path, bundle).tensors
    except UpdateError as err:
        raise PersonalisationError(str(err)) from None


def bundle_lora(bundle: Bundle, history: int = 0) -> ActiveLora:
    """The bundle's own exported LoRA (float32), whatever the device has personalised."""
    return ActiveLora(tensors={k: np.asarray(v, np.float32) for k, v in bundle.lora().items()},
                      source="bundle", file=bundle.file("lora"), history=history)


def active_lora(bundle: Bundle) -> ActiveLora:
    """The LoRA inference should run, verified (the bundle's own when not personalised)."""
    state = read_state(bundle)
    if state is None or state.get("active") is None:
        return bundle_lora(bundle, history=len(state["history"]) if state else 0)
    entry = state["active"]
    return ActiveLora(tensors=_load_entry(bundle, entry), source="personalised", file=_entry_path(bundle, entry),
                      entry=entry, history=len(state["history"]))


def _write_state(bundle: Bundle, state: dict[str, Any]) -> None:
    """Replace ``state.json`` atomically: the commit point of every change."""
    data = (json.dumps(state, indent=2, sort_keys=True) + "\n").encode("utf-8")
    write_bytes(state_dir(bundle) / STATE, data)


def _cleanup(bundle: Bundle, state: dict[str, Any]) -> None:
    """Remove LoRA files the state no longer references, and this process's (or dead ones') temp
    files; call with the lock held (another process's unreferenced file may be its next entry)."""
    keep = {e["file"] for e in [state.get("active"), *state["history"]] if e}
    for path in state_dir(bundle).iterdir():
        if path.name == STATE or path.name in keep:
            continue
        if (path.name.startswith("lora-") and path.suffix == ".safetensors") or temp_is_removable(path.name):
            path.unlink(missing_ok=True)


def apply_update(bundle: Bundle, update_path: str | os.PathLike, keep: int = DEFAULT_KEEP) -> ActiveLora:
    """Make the LoRA of the update file ``update_path`` the device's active LoRA; the previous one goes
    to history."""
    update = read_update(update_path, bundle)  # names, shapes, bundle id: refuse before changing anything
    return _apply(bundle, update, lambda target: copy_file(update.path, target), str(Path(update_path).resolve()),
                  keep)


def apply_update_bytes(bundle: Bundle, data: bytes, source: str | None = None,
                       keep: int = DEFAULT_KEEP) -> ActiveLora:
    """`apply_update` for an update held in memory (`edge_client.update.update_bytes`: a training whose
    result no update file keeps, or the bytes of the file just written, ``source``), stored byte for byte."""
    update = parse_update(data, bundle)  # the checks `read_update` makes of a file
    return _apply(bundle, update, lambda target: write_bytes(target, data), source, keep)


def reapply(moved: ActiveLora, bundle: Bundle, keep: int = DEFAULT_KEEP) -> ActiveLora:
    """The personalised LoRA a refresh moved to ``previous/`` (``moved``, read before the refresh), made the
    active LoRA of the refreshed ``bundle`` again: what `edge-client join --personalise` asks for
    (docs/howto/refresh.md). Its tensors are stored as a new update of this bundle, with the training's
    examples and loss; the moved copy stays in ``previous/`` for `edge-client rollback --refresh`."""
    trained = (moved.entry or {}).get("update") or {}
    data = update_bytes(moved.tensors, bundle=bundle, num_examples=int(trained.get("num_examples") or 1),
                        mean_loss=float(trained.get("mean_loss") or 0.0), where=str(moved.file))
    return apply_update_bytes(bundle, data, source=f"re-applied after a refresh: {moved.file}", keep=keep)


def _apply(bundle: Bundle, update: Update, store: Callable[[Path], Path], source: str | None,
           keep: int) -> ActiveLora:
    """Store ``update`` (``store(target)`` writes its bytes) as the next personalised LoRA and commit it."""
    with personalisation_lock(bundle.path):
        if update.bundle_id != bundle.id:  # a refresh moved the bundle on since the update was read
            raise PersonalisationError(f"{update.path or 'the trained LoRA'}: trained on bundle "
                                       f"{update.bundle_id[:12]}, which was refreshed meanwhile (now "
                                       f"{bundle.id[:12]}); not applied")
        directory = _writable_state_dir(bundle)
        state = read_state(bundle) or _empty_state(bundle)
        name = f"lora-{state['next']:04d}.safetensors"
        target = store(directory / name)
        entry = {"file": name, "sha256": sha256_file(target), "bytes": target.stat().st_size, "applied": utc_now(),
                 "update": {**({"source": source} if source else {}),
                            **{k: update.metadata[k] for k in _UPDATE_KEYS if k in update.metadata}}}
        history = ([state["active"]] if state.get("active") else []) + list(state["history"])
        new_state = {**state, "active": entry, "history": history[:max(0, int(keep))], "next": state["next"] + 1}
        _write_state(bundle, new_state)  # the commit point
        _cleanup(bundle, new_state)
    return ActiveLora(tensors=update.tensors, source="personalised", file=target, entry=entry,
                      history=len(new_state["history"]))


def rollback(bundle: Bundle, to_bundle: bool = False) -> ActiveLora:
    """Go back to the previous LoRA; returns the now active one.

    ``to_bundle`` discards every personalisation (also a corrupt state or one of another
    bundle) and returns to the bundle's own LoRA."""
    if not state_dir(bundle).exists():
        raise _nothing(bundle)
    with personalisation_lock(bundle.path):
        _rollback_locked(bundle, to_bundle)
    return active_lora(bundle)


def _nothing(bundle: Bundle) -> NothingToRollBack:
    return NothingToRollBack(f"{bundle.path}: nothing to roll back (the bundle's own LoRA is active)")


def _rollback_locked(bundle: Bundle, to_bundle: bool) -> None:
    """`rollback`'s change of the state, with the personalisation lock held."""
    directory = state_dir(bundle)
    if to_bundle:
        if not directory.exists():
            raise _nothing(bundle)
        aside = directory.with_name(f".{PERSONALISED}.removed-{os.getpid()}-{os.urandom(4).hex()}")
        os.replace(directory, aside)  # the commit point: one rename
        if aside.is_symlink():
            aside.unlink()  # a link planted as personalised/: it goes, what it points at stays
        shutil.rmtree(aside, ignore_errors=True)
        return
    _writable_state_dir(bundle)
    state = read_state(bundle)
    if state is None or state.get("active") is None:
        raise _nothing(bundle)
    if not state["history"]:
        new_state = {**state, "active": None, "history": []}
    else:
        previous = state["history"][0]
        _load_entry(bundle, previous)  # verify before committing to it
        new_state = {**state, "active": previous, "history": state["history"][1:]}
    _write_state(bundle, new_state)
    _cleanup(bundle, new_state)
