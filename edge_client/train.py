"""LoRA-only local training on the device with the bundle's torch.export training program.

Needs torch (``pip install fedmvp[edge-train]``), imported lazily: scanning the data folder
(``edge_client.local_data``) and every error about it or the options (``TrainOptions``)
happen before torch loads, and nothing here is imported by the inference path. Neither
``fedmvp`` nor open_clip is needed: the program (``train.pt2``) holds the whole graph and
takes every tensor as an input, the frozen ones from the bundle's ``weights.safetensors``;
only the LoRA tensors get ``requires_grad``.

Loss (docs/method.md §5, ``fedmvp_formats.objective``, the one the server's model trains too):
``CE(logits, y) + alpha * (1 - cos(f_prompted(x), f_CLIP(x')))``, x' a per-sample random horizontal
flip of x (probability ``method["flip_prob"]``), f_CLIP frozen; alpha is the bundle's
(``Bundle.method["alpha"]``) unless given. Optimiser (docs/method.md §6): SGD with momentum and
weight decay by default; ``optimizer="adamw"`` learns where the gradients reaching the
LoRA are tiny (a small CLIP, B near 0). Defaults live in `TrainOptions`.

On CUDA: autocast (bf16 where supported, else fp16 with a gradient scaler; fp32 master
LoRA), activation checkpointing (``edge_client.program`` cuts the graph into segments at
LayerNorm nodes, each recomputed in backward), and ``batch_size="auto"`` measures the
largest batch under ``max_memory_gb`` (``edge_client.batch_fit``). On CPU it runs too, slowly.

Training ends in memory: `TrainResult.tensors`, the trained LoRA checked as an update file's
would be (``edge_client.update.update_bytes``: the bundle's names and shapes, float32, finite).
Only then is anything written, and only what was asked: the update file, atomically, where
``options.out`` names one (``edge-client train`` always; a federation node only with ``--out``,
its reply carries the tensors themselves); personalisation (``options.apply``), committed by one
rename of ``personalised/state.json`` (``edge_client.lora_store``). An interrupted run (Ctrl-C,
kill) leaves the bundle and the output directory as they were. The bundle's lock
(``edge_client.bundle_lock``) is held from reading the active LoRA to applying the new one, so
a second train, a refresh or a rollback meanwhile is refused (or waits), never interleaved.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from fedmvp_formats.atomic import write_bytes
from fedmvp_formats.privacy import PrivacyRecord

from edge_client.bundle import Bundle
from edge_client.bundle_lock import bundle_lock
from edge_client.local_data import LocalDataset, scan_folder
from edge_client.lora_store import ActiveLora, apply_update_bytes, state_dir
from edge_client.train_options import TrainingError, TrainInputError, TrainOptions
from edge_client.train_run import TrainingRun
from edge_client.update import check_lora
from edge_client.write_guard import WriteTargetError, check_output_file, probe_writable


# ---- training ------------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    """What `train_local` did and wrote: the trained LoRA itself (``tensors``) and the update file, if any."""

    update_path: Path | None  # None: no update file was asked for (``options.out`` None)
    bundle: Path
    num_examples: int
    classes: list[str]
    epochs: int
    batch_size: int
    device: str
    mean_loss: float
    final_loss: float
    epoch_losses: list[float]
    seconds: float
    alpha: float
    lr: float
    started_from: str
    optimizer: str = "sgd"
    personalised: ActiveLora | None = None
    skipped: list[str] = field(default_factory=list)
    autocast: str | None = None
    checkpoint_segments: int = 1
    tensors: dict[str, np.ndarray] = field(default_factory=dict, repr=False)  # the trained LoRA, float32
    privacy: dict[str, Any] | None = None  # [privacy]: mode, clip_norm, the delta's norm before the clip
    program: str = "pt2"  # what it trained through: pt2 (train.pt2) or torchscript (train.torchscript.pt)
    program_note: str | None = None  # why: the fallback's one line (train.pt2 does not load with this torch)

    def to_json(self) -> dict[str, Any]:
        """The `edge-client train --json` report."""
        return {"ok": True, "update": str(self.update_path) if self.update_path else None,
                "bundle": str(self.bundle),
                "num_examples": self.num_examples, "classes": self.classes, "epochs": self.epochs,
                "batch_size": self.batch_size, "device": self.device, "autocast": self.autocast,
                "checkpoint_segments": self.checkpoint_segments, "mean_loss": round(self.mean_loss, 6),
                "final_loss": round(self.final_loss, 6), "epoch_losses": [round(x, 6) for x in self.epoch_losses],
                "seconds": round(self.seconds, 3), "alpha": self.alpha, "lr": self.lr,
                "optimizer": self.optimizer, "started_from": self.started_from,
                "personalised": self.personalised.to_json() if self.personalised else None,
                "skipped": self.skipped, "privacy": self.privacy, "program": self.program,
                "program_note": self.program_note}


def default_out_path(out: str | os.PathLike, bundle: Bundle, round_number: int | None = None) -> Path:
    """``out`` itself when it names a .safetensors file, else ``out/update-rNNNN-<UTC time>.safetensors``, NNNN
    the round it was trained from (``round_number``, a federation message's; default the bundle's)."""
    out = Path(out)
    if out.suffix == ".safetensors":
        return out
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    round_number = bundle.round if round_number is None else round_number
    tag = f"r{round_number:04d}" if round_number is not None else "r----"
    return out / f"update-{tag}-{stamp}.safetensors"


def check_write_targets(options: TrainOptions, bundle: Bundle, allow_run_dir: bool = False,
                        round_number: int | None = None) -> Path | None:
    """The update file's path (None: ``options.out`` asks for none), refused (`TrainInputError`)
    before training if writing it could replace someone else's file or cannot succeed
    (edge_client.write_guard); with apply, also the personalisation directory must be writable.
    ``allow_run_dir``: the caller owns the run directory the update goes into (`fedmvp demo`
    keeps its updates in RUN/edge/updates)."""
    target = None if options.out is None else default_out_path(options.out, bundle, round_number)
    try:
        if target is not None:
            check_output_file(target, allow_run_dir=allow_run_dir)
            probe_writable(target.parent, "update file")
        if options.apply:
            where = state_dir(bundle)
            probe_writable(where if where.is_dir() else Path(bundle.path), "personalised LoRA")
    except WriteTargetError as err:
        raise TrainInputError(str(err)) from None
    return target


def train_local(data: str | os.PathLike | LocalDataset, bundle: str | os.PathLike | Bundle | None = None,
                options: TrainOptions | None = None, *, progress: bool = False,
                on_step: Callable[[int, float], None] | None = None,
                start_lora: Mapping[str, np.ndarray] | None = None, allow_run_dir: bool = False,
                wait: float = 0.0, privacy: PrivacyRecord | None | str = "bundle", break_lock: bool = False,
                start_round: int | None = None, **overrides: Any) -> TrainResult:
    """Train the bundle's LoRA on ``data`` (ImageFolder of bundle classes); the result holds the trained
    tensors (`TrainResult.tensors`) and, where ``options.out`` names one, the update file written.

    ``data``: the folder, or an already scanned `LocalDataset` (e.g. a node's training share).
    ``bundle``: a `Bundle`, or a directory resolved by `Bundle.resolve_dir`. ``options``
    (default `TrainOptions()`) with any field overridden by keyword, e.g. ``epochs=20,
    optimizer="adamw"``; see `TrainOptions` for each. ``progress`` shows tqdm bars on stderr;
    ``on_step(step, loss)`` is called after every step. ``start_lora``: start from these LoRA
    tensors (a federation round's global LoRA, the state of round ``start_round``: the update names that
    round and state as its base) instead of ``options.start``'s. ``options.out`` None:
    no update file. The update file may not land inside a bundle or (unless ``allow_run_dir``) a run
    directory, nor replace a file; ``options.apply`` makes the result the device's active LoRA.
    The bundle's lock is held throughout (``edge_client.bundle_lock``): the LoRA it starts from is
    still the active one when the result is applied; ``wait``: seconds to wait for another holder;
    ``break_lock``: take over a lock whose record names another host (docs/security.md).
    ``privacy``: the ``[privacy]`` settings the result obeys (``"bundle"``: the manifest's, `Bundle.privacy`;
    None: none): its delta against ``start_lora`` (else the bundle's LoRA, what the server subtracts) is
    clipped to ``clip_norm`` and, in local mode, noised before anything is written (docs/howto/privacy.md).
    Raises `TrainInputError` (bad data/options), `BundleError` (bad bundle; `BundleBusy`: locked) or
    `TrainingError`.
    """
    began = time.perf_counter()
    options = dataclasses.replace(options or TrainOptions(), **overrides)  # checks them (TrainInputError)
    with bundle_lock(bundle.path if isinstance(bundle, Bundle) else Bundle.resolve_dir(bundle), wait,
                     break_lock=break_lock):
        return _train_locked(data, Bundle.open(bundle, verify=True), options, began, progress, on_step, start_lora,
                             allow_run_dir, privacy, start_round)


def _train_locked(data: str | os.PathLike | LocalDataset, bundle: Bundle, options: TrainOptions, began: float,
                  progress: bool, on_step: Callable[[int, float], None] | None,
                  start_lora: Mapping[str, np.ndarray] | None, allow_run_dir: bool,
                  privacy: PrivacyRecord | None | str = "bundle", start_round: int | None = None) -> TrainResult:
    """`train_local` with the bundle's lock held and the bundle verified."""
    bundle.require_trainable()
    settings = bundle.privacy if privacy == "bundle" else privacy
    dataset = data if isinstance(data, LocalDataset) else scan_folder(data, bundle.class_names)
    initial = None
    if start_lora is not None:
        tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in start_lora.items()}
        check_lora(tensors, bundle.lora_shapes, bundle.path, TrainInputError)
        initial = ActiveLora(tensors=tensors, source="global", file=bundle.path, round=start_round)
    alpha = float(bundle.method["alpha"]) if options.alpha is None else float(options.alpha)
    target = check_write_targets(options, bundle, allow_run_dir, start_round)

    torch = _torch()
    previous_threads = torch.get_num_threads()
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    try:
        result, update = _train(torch, bundle, dataset, began, options, alpha, progress, on_step, initial, settings)
    finally:
        torch.set_num_threads(previous_threads)
    return _keep(result, update, bundle, options, target)


def _train(torch: Any, bundle: Bundle, dataset: LocalDataset, began: float, o: TrainOptions, alpha: float,
           progress: bool, on_step: Callable[[int, float], None] | None,
           initial: ActiveLora | None = None, privacy: PrivacyRecord | None = None) -> tuple[TrainResult, bytes]:
    """The training loop proper (torch loaded, options ``o`` checked), in memory: the result and the
    update's bytes (`update_bytes`, checked against the bundle); nothing is written."""
    run = TrainingRun(torch, bundle, dataset, o, alpha)
    run.prepare(initial, progress)
    generator = torch.Generator().manual_seed(int(o.seed))
    batch = run.batch_size()
    epoch_losses, total_loss, total_seen = run.epochs(batch, generator, progress, on_step)
    trained, kept_privacy = run.privatised(privacy)
    data, report = run.update(trained, began, epoch_losses, total_loss / total_seen)
    return TrainResult(update_path=None, batch_size=batch, tensors=trained, privacy=kept_privacy, **report), data


def _keep(result: TrainResult, data: bytes, bundle: Bundle, o: TrainOptions, target: Path | None) -> TrainResult:
    """Write what was asked for, after training: the update file (``target``: ``o.out``'s) and the
    personalisation (``o.apply``), both from the update's bytes ``data``, so the two are byte for byte equal."""
    if target is not None:
        try:
            result.update_path = write_bytes(target, data)
        except OSError as err:  # a full disk, a directory made read-only meanwhile: one line, nothing half-written
            raise TrainingError(f"{target}: cannot write the update ({err.strerror or err}); nothing was "
                                f"written, the bundle is unchanged") from None
    if o.apply:
        try:
            result.personalised = apply_update_bytes(bundle, data, source=str(target.resolve()) if target else None)
        except OSError as err:
            written = f"the update file {target} was written, " if target is not None else ""
            raise TrainingError(f"{state_dir(bundle)}: cannot apply the update ({err.strerror or err}); "
                                f"{written}the device's LoRA is unchanged") from None
    if target is not None or o.apply:
        _keep_device_id(bundle)
    return result


def _keep_device_id(bundle: Bundle) -> None:
    """The device id the update names, kept in the bundle (``edge_client.device_id``) now that it is written."""
    from edge_client.device_id import keep_device_id

    try:
        keep_device_id(bundle.path)
    except OSError as err:
        raise TrainingError(f"{bundle.path}: the update was written but the device's id could not be kept "
                            f"({err.strerror or err}); the next update will name another id") from None


def _torch() -> Any:
    """torch, or a `TrainingError` saying what to install."""
    try:
        import torch
    except ImportError as err:
        raise TrainingError(f"local training needs torch ({err}); install fedmvp[edge-train]") from None
    return torch
