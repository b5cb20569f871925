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
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from fedmvp_formats.atomic import write_bytes
from fedmvp_formats.objective import fedmvp_objective
from fedmvp_formats.privacy import LOCAL, PrivacyRecord, privatise

from edge_client.batch_fit import auto_batch, probe_step
from edge_client.bundle import Bundle
from edge_client.bundle_lock import bundle_lock
from edge_client.local_data import LocalDataset, decode_dataset, images_digest, scan_folder
from edge_client.lora_store import ActiveLora, active_lora, apply_update_bytes, bundle_lora, state_dir
from edge_client.program import GraphRunner, load_program
from edge_client.safetensors_check import load_safetensors
from edge_client.train_options import TrainingError, TrainInputError, TrainOptions
from edge_client.update import UpdateError, check_lora, update_bytes
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
                "skipped": self.skipped, "privacy": self.privacy}


def default_out_path(out: str | os.PathLike, bundle: Bundle) -> Path:
    """``out`` itself when it names a .safetensors file, else ``out/update-rNNNN-<UTC time>.safetensors``."""
    out = Path(out)
    if out.suffix == ".safetensors":
        return out
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    round_number = bundle.round
    tag = f"r{round_number:04d}" if round_number is not None else "r----"
    return out / f"update-{tag}-{stamp}.safetensors"


def check_write_targets(options: TrainOptions, bundle: Bundle, allow_run_dir: bool = False) -> Path | None:
    """The update file's path (None: ``options.out`` asks for none), refused (`TrainInputError`)
    before training if writing it could replace someone else's file or cannot succeed
    (edge_client.write_guard); with apply, also the personalisation directory must be writable.
    ``allow_run_dir``: the caller owns the run directory the update goes into (`fedmvp demo`
    keeps its updates in RUN/edge/updates)."""
    target = None if options.out is None else default_out_path(options.out, bundle)
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
                **overrides: Any) -> TrainResult:
    """Train the bundle's LoRA on ``data`` (ImageFolder of bundle classes); the result holds the trained
    tensors (`TrainResult.tensors`) and, where ``options.out`` names one, the update file written.

    ``data``: the folder, or an already scanned `LocalDataset` (e.g. a node's training share).
    ``bundle``: a `Bundle`, or a directory resolved by `Bundle.resolve_dir`. ``options``
    (default `TrainOptions()`) with any field overridden by keyword, e.g. ``epochs=20,
    optimizer="adamw"``; see `TrainOptions` for each. ``progress`` shows tqdm bars on stderr;
    ``on_step(step, loss)`` is called after every step. ``start_lora``: start from these LoRA
    tensors (a federation round's global LoRA) instead of ``options.start``'s. ``options.out`` None:
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
                             allow_run_dir, privacy)


def _train_locked(data: str | os.PathLike | LocalDataset, bundle: Bundle, options: TrainOptions, began: float,
                  progress: bool, on_step: Callable[[int, float], None] | None,
                  start_lora: Mapping[str, np.ndarray] | None, allow_run_dir: bool,
                  privacy: PrivacyRecord | None | str = "bundle") -> TrainResult:
    """`train_local` with the bundle's lock held and the bundle verified."""
    bundle.require_trainable()
    settings = bundle.privacy if privacy == "bundle" else privacy
    dataset = data if isinstance(data, LocalDataset) else scan_folder(data, bundle.class_names)
    initial = None
    if start_lora is not None:
        tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in start_lora.items()}
        check_lora(tensors, bundle.lora_shapes, bundle.path, TrainInputError)
        initial = ActiveLora(tensors=tensors, source="global", file=bundle.path)
    alpha = float(bundle.method["alpha"]) if options.alpha is None else float(options.alpha)
    target = check_write_targets(options, bundle, allow_run_dir)

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
    import torch.nn.functional as F

    dev = _device(torch, o.device)
    on_cuda = dev.type == "cuda"
    use_autocast = on_cuda if o.autocast is None else bool(o.autocast)
    amp_dtype = None
    if use_autocast:
        amp_dtype = torch.bfloat16 if (not on_cuda or torch.cuda.is_bf16_supported()) else torch.float16
    runner = load_program(bundle)
    segments = _segments(runner, o.checkpoint_segments, on_cuda)

    pixels_u8, labels_np = decode_dataset(dataset, bundle.preprocess, max_pixels=o.max_pixels, progress=progress)
    n = len(labels_np)
    weights = {k: v.to(dev) for k, v in sorted(load_safetensors(bundle.file("weights"), framework="pt").items())}
    if initial is None:
        initial = active_lora(bundle) if o.start == "active" else bundle_lora(bundle)
    lora = {k: torch.tensor(np.asarray(v, np.float32), device=dev).requires_grad_(True)
            for k, v in sorted(initial.tensors.items())}
    spec = bundle.preprocess
    mean = torch.tensor(spec.mean, dtype=torch.float32, device=dev).view(1, 3, 1, 1)
    std = torch.tensor(spec.std, dtype=torch.float32, device=dev).view(1, 3, 1, 1)
    pixels = torch.from_numpy(pixels_u8)  # [N, S, S, 3] uint8 on the host
    labels = torch.from_numpy(labels_np)

    def batch_tensors(index: Any, flip: Any) -> tuple[Any, Any, Any]:
        x = pixels[index].to(dev, non_blocking=True).permute(0, 3, 1, 2).float().div_(255.0)
        x = (x - mean) / std
        view = torch.where(flip.to(dev).view(-1, 1, 1, 1), x.flip(-1), x)
        return x, view, labels[index].to(dev)

    def forward_loss(x: Any, view: Any, y: Any, tensors: dict[str, Any]) -> Any:
        with torch.autocast(dev.type, dtype=amp_dtype, enabled=use_autocast):
            features, logits, frozen = runner(x, view, tensors, weights, segments=segments)
        return fedmvp_objective(features, logits, frozen, y, alpha, F)["loss"]

    generator = torch.Generator().manual_seed(int(o.seed))
    if o.batch_size == "auto":
        batch = auto_batch(torch, dev, n, o.max_memory_gb, lambda b: probe_step(
            torch, dev, b, n, batch_tensors, forward_loss, lora))
    else:
        batch = min(int(o.batch_size), n)
    params = list(lora.values())
    opt = torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay) \
        if o.optimizer == "sgd" else torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay)
    scaler = torch.amp.GradScaler("cuda") if (use_autocast and on_cuda and amp_dtype == torch.float16) else None

    steps_per_epoch = math.ceil(n / batch)
    bar = _bar(o.epochs * steps_per_epoch, progress)
    epoch_losses: list[float] = []
    total_loss, total_seen, step = 0.0, 0, 0
    flip_prob = float(bundle.method["flip_prob"])  # the consistency view, as the server trained it
    try:
        for _epoch in range(o.epochs):
            order = torch.randperm(n, generator=generator)
            flips = torch.rand(n, generator=generator) < flip_prob
            epoch_sum, epoch_seen = 0.0, 0
            for first in range(0, n, batch):
                index = order[first:first + batch]
                x, view, y = batch_tensors(index, flips[index])
                opt.zero_grad(set_to_none=True)
                loss = forward_loss(x, view, y, lora)
                value = float(loss.detach())
                if not math.isfinite(value):
                    raise TrainingError(f"the loss became {value} at step {step + 1}; nothing was written "
                                        f"(try a lower --lr)")
                if scaler is not None:
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                else:
                    loss.backward()
                    opt.step()
                step += 1
                epoch_sum += value * len(index)
                epoch_seen += len(index)
                bar.set_postfix(loss=f"{epoch_sum / epoch_seen:.4f}", refresh=False)
                bar.update(1)
                if on_step is not None:
                    on_step(step, value)
            epoch_losses.append(epoch_sum / epoch_seen)
            total_loss += epoch_sum
            total_seen += epoch_seen
    finally:
        bar.close()
    trained = {k: v.detach().float().cpu().numpy() for k, v in lora.items()}
    kept_privacy = None
    if privacy is not None:  # the delta the server will see, bounded (and noised) before it exists anywhere
        reference = initial.tensors if initial.source == "global" else bundle_lora(bundle).tensors
        trained, norm = privatise(trained, reference, privacy)
        if norm == 0.0:  # the post-step weight check Opacus users had to add: a DP round must move the LoRA
            raise TrainingError("the LoRA did not change in training (its delta is 0); nothing was written")
        kept_privacy = {"mode": privacy.mode, "clip_norm": privacy.clip_norm, "delta_norm": norm,
                        "clipped": norm > privacy.clip_norm, "noised": privacy.mode == LOCAL}
    seconds = time.perf_counter() - began
    mean_loss = total_loss / total_seen
    try:  # the checks an update file's reader makes, on the tensors in memory
        data = update_bytes(trained, bundle=bundle, num_examples=n, mean_loss=mean_loss, final_loss=epoch_losses[-1],
                            epochs=o.epochs, train_seconds=round(seconds, 3), classes=dataset.classes,
                            device=dev.type, alpha=alpha, lr=o.lr, optimizer=o.optimizer, started_from=initial.source,
                            images_digest=images_digest(pixels_u8, labels_np))  # counted once: docs/howto/ingest.md
    except UpdateError as err:
        raise TrainingError(f"{err}; nothing was written") from None
    result = TrainResult(update_path=None, bundle=bundle.path, num_examples=n, classes=dataset.classes,
                         epochs=o.epochs, batch_size=batch, device=str(dev), mean_loss=mean_loss,
                         final_loss=epoch_losses[-1], epoch_losses=epoch_losses, seconds=seconds, alpha=alpha,
                         lr=o.lr, optimizer=o.optimizer, started_from=initial.source, skipped=list(dataset.skipped),
                         autocast=str(amp_dtype).replace("torch.", "") if use_autocast else None,
                         checkpoint_segments=len(runner.plan(segments)), tensors=trained, privacy=kept_privacy)
    return result, data


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
    return result


def _torch() -> Any:
    """torch, or a `TrainingError` saying what to install."""
    try:
        import torch
    except ImportError as err:
        raise TrainingError(f"local training needs torch ({err}); install fedmvp[edge-train]") from None
    return torch


def _device(torch: Any, device: str) -> Any:
    """auto | cpu | cuda -> a torch.device; asking for CUDA without it is a `TrainInputError`."""
    key = (device or "auto").lower()
    if key == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if key == "cuda" and not torch.cuda.is_available():
        raise TrainInputError("--device cuda: CUDA is not available to torch on this machine")
    if key not in ("cpu", "cuda"):
        raise TrainInputError(f"--device must be auto, cpu or cuda, got {device!r}")
    return torch.device(key)


def _segments(runner: GraphRunner, requested: int | None, on_cuda: bool) -> int:
    """Checkpointed pieces to cut the graph into: none on CPU, one block per piece on CUDA."""
    if requested is None:
        requested = 0 if on_cuda else 1
    if requested == 0:  # auto: about two LayerNorms (one transformer block) per piece
        return max(2, runner.max_segments() // 2)
    return max(1, int(requested))


class _NoBar:
    """The part of tqdm's interface the loop uses, doing nothing (``progress=False``)."""

    def set_postfix(self, **_: Any) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _bar(total: int, progress: bool) -> Any:
    """A step progress bar on stderr, or `_NoBar`."""
    if not progress:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)
