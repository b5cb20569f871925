"""LoRA-only local training on the device with the bundle's torch.export training program.

Needs torch (``pip install fedmvp[edge-train]``), imported lazily: scanning the data folder
and every error about it happen before torch loads, and nothing here is imported by the
inference path. Neither ``fedmvp`` nor open_clip is needed: the program (``train.pt2``)
holds the whole graph and takes every tensor as an input, the frozen ones from the
bundle's ``weights.safetensors``; only the LoRA tensors get ``requires_grad``.

Loss (SPEC section 5): ``CE(logits, y) + alpha * (1 - cos(f_prompted(x), f_CLIP(x')))``,
x' a per-sample random horizontal flip of x, f_CLIP frozen; alpha from the manifest when
it records one, else 10. SGD lr 0.003, momentum 0.9, weight decay 1e-5 (SPEC section 6) by
default; ``optimizer="adamw"`` (the usual LoRA optimizer) learns where the gradients reaching the
LoRA are tiny (a small CLIP, B near 0): on the demo bundle SGD at 0.003 leaves held-out accuracy
where it was, AdamW at 0.01 adds 7-10 points (fedmvp/demo_edge.py).

On CUDA: autocast (bf16 where supported, else fp16 with a gradient scaler; fp32 master
LoRA), activation checkpointing (the program's graph is cut into segments at LayerNorm
nodes and each segment is recomputed in backward), and ``batch_size="auto"`` probes
doubling batch sizes with a real forward/backward and keeps the largest whose peak memory
stays under ``max_memory_gb``. On CPU it runs too, slowly.

Nothing is written until training has finished: the update file is written to a temp file
and renamed; personalisation is committed by one rename of ``personalised/state.json``
(``edge_client.lora_store``). An interrupted run (Ctrl-C, kill) leaves the bundle and the
output directory as they were.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.bundle import Bundle, read_bundle
from edge_client.images import DEFAULT_MAX_PIXELS, ImageReadError, is_image_path, iter_image_paths, load_image
from edge_client.lora_store import ActiveLora, active_lora, apply_update
from edge_client.program import GraphRunner, load_program
from edge_client.preprocess import center_crop, resize_shorter_side
from edge_client.update import bundle_round, write_update

DEFAULT_EPOCHS = 5
DEFAULT_LR = 0.003
DEFAULT_MOMENTUM = 0.9
DEFAULT_WEIGHT_DECAY = 1e-5
DEFAULT_ALPHA = 10.0
OPTIMIZERS = ("sgd", "adamw")  # sgd: SPEC section 6 (momentum, weight decay); adamw: decoupled weight decay
DEFAULT_OUT = "updates"
CPU_AUTO_BATCH = 32
MAX_AUTO_BATCH = 1024
_RESAMPLE = {"bicubic-shortest-side": 3, "bilinear-shortest-side": 2}  # PIL BICUBIC / BILINEAR


class TrainInputError(ValueError):
    """Bad local data or options (unknown class, no images, ...): nothing was trained."""


class TrainingError(RuntimeError):
    """Training could not run or diverged: nothing was written."""


# ---- the local data -----------------------------------------------------------------------------------
@dataclass
class LocalDataset:
    """An ImageFolder tree resolved against the bundle's classes (paths only, nothing decoded)."""

    root: Path
    files: list[Path]
    labels: list[int]
    classes: list[str]  # class folders that hold images, sorted
    skipped: list[str] = field(default_factory=list)  # one line per file or folder left out

    def __len__(self) -> int:
        return len(self.files)


def scan_folder(root: str | os.PathLike, class_names: Sequence[str]) -> LocalDataset:
    """``root/<class>/**/image`` -> files and label indices into ``class_names``.

    Every non-hidden sub-directory of ``root`` must be a class of the bundle; unknown ones are
    a `TrainInputError` naming them. Image files directly in ``root`` are left out (reported)."""
    root = Path(root)
    if not root.is_dir():
        raise TrainInputError(f"{root}: not a directory (expected an ImageFolder tree: {root}/<class>/<image>)")
    index = {name: i for i, name in enumerate(class_names)}
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    unknown = [p.name for p in folders if p.name not in index]
    if unknown:
        shown = ", ".join(class_names[:20]) + (", ..." if len(class_names) > 20 else "")
        raise TrainInputError(f"{root}: unknown class{'es' if len(unknown) > 1 else ''} "
                              f"{', '.join(repr(u) for u in unknown)}: not in the bundle's {len(class_names)} "
                              f"classes ({shown})")
    if not folders:
        raise TrainInputError(f"{root}: no class folders (expected {root}/<class>/<image>)")
    skipped = [f"{p}: not in a class folder, left out" for p in sorted(root.iterdir())
               if p.is_file() and is_image_path(p)]
    files: list[Path] = []
    labels: list[int] = []
    present: list[str] = []
    for folder in folders:
        errors: list[ImageReadError] = []
        found = iter_image_paths([folder], errors=errors)
        skipped.extend(f"{e.path}: {e.reason}" for e in errors)
        if found:
            present.append(folder.name)
        files.extend(found)
        labels.extend([index[folder.name]] * len(found))
    if not files:
        raise TrainInputError(f"{root}: no images in the class folders")
    return LocalDataset(root=root, files=files, labels=labels, classes=present, skipped=skipped)


def decode_dataset(dataset: LocalDataset, spec: Any, max_pixels: int | None = DEFAULT_MAX_PIXELS,
                   progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Resize + crop every image once: (uint8 [N, S, S, 3], labels [N]); unreadable files are skipped."""
    arrays, labels = [], []
    for path, label in _progress(list(zip(dataset.files, dataset.labels)), progress, "read"):
        try:
            image = load_image(path, max_pixels=max_pixels)
            image = center_crop(resize_shorter_side(image, spec.image_size, _RESAMPLE[spec.resize]), spec.image_size)
            arrays.append(np.asarray(image.convert("RGB") if image.mode != "RGB" else image, dtype=np.uint8))
            labels.append(label)
        except ImageReadError as err:
            dataset.skipped.append(str(err))
    if not arrays:
        raise TrainInputError(f"{dataset.root}: none of the {len(dataset.files)} images could be read")
    return np.stack(arrays), np.asarray(labels, dtype=np.int64)


# ---- training -----------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    """What `train_local` did and wrote."""

    update_path: Path
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

    def to_json(self) -> dict[str, Any]:
        return {"ok": True, "update": str(self.update_path), "bundle": str(self.bundle),
                "num_examples": self.num_examples, "classes": self.classes, "epochs": self.epochs,
                "batch_size": self.batch_size, "device": self.device, "autocast": self.autocast,
                "checkpoint_segments": self.checkpoint_segments, "mean_loss": round(self.mean_loss, 6),
                "final_loss": round(self.final_loss, 6), "epoch_losses": [round(x, 6) for x in self.epoch_losses],
                "seconds": round(self.seconds, 3), "alpha": self.alpha, "lr": self.lr,
                "optimizer": self.optimizer, "started_from": self.started_from,
                "personalised": self.personalised.to_json() if self.personalised else None,
                "skipped": self.skipped}


def manifest_alpha(bundle: Bundle) -> float:
    """alpha recorded by the exporter (training.alpha, loss.alpha or train.alpha), else 10."""
    m = bundle.manifest
    for section in ("training", "loss", "train"):
        value = (m.get(section) or {}).get("alpha") if isinstance(m.get(section), dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return DEFAULT_ALPHA


def fedmvp_loss(features: Any, logits: Any, frozen: Any, labels: Any, alpha: float) -> Any:
    """CE(logits, y) + alpha * mean(1 - cos(prompted, frozen)); computed in float32."""
    import torch.nn.functional as F

    ce = F.cross_entropy(logits.float(), labels)
    consistency = (1.0 - F.cosine_similarity(features.float(), frozen.float(), dim=-1)).mean()
    return ce + alpha * consistency


def find_batch_size(probe: Callable[[int], int], cap: int, max_bytes: int, start: int = 1) -> int:
    """Largest batch (doubling from ``start`` up to ``cap``) whose ``probe(batch)`` peak bytes stay
    within ``max_bytes``; a probe raising MemoryError (CUDA OOM included) counts as over."""
    best, batch = 0, max(1, min(start, cap))
    while True:
        try:
            peak = probe(batch)
        except MemoryError:
            break
        if peak > max_bytes:
            break
        best = batch
        if batch >= cap:
            break
        batch = min(batch * 2, cap)
    if best == 0:
        raise TrainingError(f"batch 1 does not fit in {max_bytes / 2**30:.2f} GiB; raise --max-memory-gb")
    return best


def default_out_path(out: str | os.PathLike, bundle: Bundle) -> Path:
    """``out`` itself when it names a .safetensors file, else ``out/update-rNNNN-<UTC time>.safetensors``."""
    out = Path(out)
    if out.suffix == ".safetensors":
        return out
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    round_number = bundle_round(bundle)
    tag = f"r{round_number:04d}" if round_number is not None else "r----"
    return out / f"update-{tag}-{stamp}.safetensors"


def train_local(data: str | os.PathLike, bundle: str | os.PathLike | Bundle | None = None, *,
                epochs: int = DEFAULT_EPOCHS, batch_size: int | str = "auto", max_memory_gb: float | None = None,
                out: str | os.PathLike = DEFAULT_OUT, lr: float = DEFAULT_LR, momentum: float = DEFAULT_MOMENTUM,
                weight_decay: float = DEFAULT_WEIGHT_DECAY, optimizer: str = "sgd", alpha: float | None = None,
                device: str = "auto",
                seed: int = 0, apply: bool = True, start: str = "active", autocast: bool | None = None,
                checkpoint_segments: int | None = None, max_pixels: int | None = DEFAULT_MAX_PIXELS,
                threads: int | None = None, progress: bool = False,
                on_step: Callable[[int, float], None] | None = None) -> TrainResult:
    """Train the bundle's LoRA on ``data`` (ImageFolder of bundle classes); write an update file.

    ``start``: "active" continues from the LoRA the device runs (a personalised one if any),
    "bundle" from the exported LoRA. ``apply``: make the result the device's active LoRA
    (previous one kept for `edge-client rollback`). ``autocast``/``checkpoint_segments``
    default to on for CUDA, off for CPU (``checkpoint_segments``: how many checkpointed pieces
    the graph is cut into; 0 = auto). ``threads``: torch CPU threads while training (restored
    afterwards). ``on_step(step, loss)`` is called after every step.
    Raises `TrainInputError` (bad data/options), `BundleError` (bad bundle) or `TrainingError`.
    """
    from edge_client.infer import resolve_bundle_dir

    began = time.perf_counter()
    if not isinstance(epochs, int) or epochs < 1:
        raise TrainInputError(f"epochs must be a positive int, got {epochs!r}")
    if start not in ("active", "bundle"):
        raise TrainInputError(f"start must be 'active' or 'bundle', got {start!r}")
    if not (isinstance(batch_size, int) and batch_size >= 1) and batch_size != "auto":
        raise TrainInputError(f"batch size must be 'auto' or a positive int, got {batch_size!r}")
    if max_memory_gb is not None and not max_memory_gb > 0:
        raise TrainInputError(f"--max-memory-gb must be > 0, got {max_memory_gb}")
    if not (lr > 0 and math.isfinite(lr)):
        raise TrainInputError(f"learning rate must be > 0, got {lr}")
    if optimizer not in OPTIMIZERS:
        raise TrainInputError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    bundle = bundle if isinstance(bundle, Bundle) else read_bundle(resolve_bundle_dir(bundle), verify=True)
    bundle.require_trainable()
    dataset = scan_folder(data, bundle.class_names)
    alpha = manifest_alpha(bundle) if alpha is None else float(alpha)

    torch = _torch()
    previous_threads = torch.get_num_threads()
    if threads is not None:
        if not isinstance(threads, int) or threads < 1:
            raise TrainInputError(f"threads must be a positive int, got {threads!r}")
        torch.set_num_threads(threads)
    try:
        return _train(torch, bundle, dataset, began, epochs=epochs, batch_size=batch_size,
                      max_memory_gb=max_memory_gb, out=out, lr=lr, momentum=momentum, weight_decay=weight_decay,
                      optimizer=optimizer, alpha=alpha, device=device, seed=seed, apply=apply, start=start,
                      autocast=autocast,
                      checkpoint_segments=checkpoint_segments, max_pixels=max_pixels, progress=progress,
                      on_step=on_step)
    finally:
        torch.set_num_threads(previous_threads)


def _train(torch: Any, bundle: Bundle, dataset: LocalDataset, began: float, *, epochs: int, batch_size: int | str,
           max_memory_gb: float | None, out: str | os.PathLike, lr: float, momentum: float, weight_decay: float,
           optimizer: str, alpha: float, device: str, seed: int, apply: bool, start: str, autocast: bool | None,
           checkpoint_segments: int | None, max_pixels: int | None, progress: bool,
           on_step: Callable[[int, float], None] | None) -> TrainResult:
    dev = _device(torch, device)
    on_cuda = dev.type == "cuda"
    use_autocast = on_cuda if autocast is None else bool(autocast)
    amp_dtype = None
    if use_autocast:
        amp_dtype = torch.bfloat16 if (not on_cuda or torch.cuda.is_bf16_supported()) else torch.float16
    runner = load_program(bundle)
    segments = _segments(runner, checkpoint_segments, on_cuda)

    pixels_u8, labels_np = decode_dataset(dataset, bundle.preprocess, max_pixels=max_pixels, progress=progress)
    n = len(labels_np)
    from safetensors.torch import load_file

    weights = {k: v.to(dev) for k, v in sorted(load_file(str(bundle.file("weights"))).items())}
    initial: ActiveLora = active_lora(bundle) if start == "active" else \
        ActiveLora(tensors=bundle.lora(), source="bundle", file=bundle.file("lora"))
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
        return fedmvp_loss(features, logits, frozen, y, alpha)

    generator = torch.Generator().manual_seed(int(seed))
    if batch_size == "auto":
        batch = _auto_batch(torch, dev, n, max_memory_gb, lambda b: _probe_step(
            torch, dev, b, n, batch_tensors, forward_loss, lora))
    else:
        batch = min(int(batch_size), n)
    params = list(lora.values())
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay) if optimizer == "sgd" \
        else torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    scaler = torch.amp.GradScaler("cuda") if (use_autocast and on_cuda and amp_dtype == torch.float16) else None

    steps_per_epoch = math.ceil(n / batch)
    bar = _bar(epochs * steps_per_epoch, progress)
    epoch_losses: list[float] = []
    total_loss, total_seen, step = 0.0, 0, 0
    try:
        for _epoch in range(epochs):
            order = torch.randperm(n, generator=generator)
            flips = torch.rand(n, generator=generator) < 0.5
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
    if not all(np.all(np.isfinite(v)) for v in trained.values()):
        raise TrainingError("the trained LoRA holds NaN or infinite values; nothing was written")
    seconds = time.perf_counter() - began
    mean_loss = total_loss / total_seen
    target = default_out_path(out, bundle)
    write_update(target, trained, bundle=bundle, num_examples=n, mean_loss=mean_loss,
                 final_loss=epoch_losses[-1], epochs=epochs, train_seconds=round(seconds, 3),
                 classes=dataset.classes, device=dev.type, alpha=alpha, lr=lr, optimizer=optimizer,
                 started_from=initial.source)
    personalised = apply_update(bundle, target) if apply else None
    return TrainResult(update_path=target, bundle=bundle.path, num_examples=n, classes=dataset.classes,
                       epochs=epochs, batch_size=batch, device=str(dev), mean_loss=mean_loss,
                       final_loss=epoch_losses[-1], epoch_losses=epoch_losses, seconds=seconds, alpha=alpha, lr=lr,
                       optimizer=optimizer,
                       started_from=initial.source, personalised=personalised, skipped=list(dataset.skipped),
                       autocast=str(amp_dtype).replace("torch.", "") if use_autocast else None,
                       checkpoint_segments=len(runner.plan(segments)))


def _torch() -> Any:
    try:
        import torch
    except ImportError as err:
        raise TrainingError(f"local training needs torch ({err}); install fedmvp[edge-train]") from None
    return torch


def _device(torch: Any, device: str) -> Any:
    key = (device or "auto").lower()
    if key == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if key == "cuda" and not torch.cuda.is_available():
        raise TrainInputError("--device cuda: CUDA is not available to torch on this machine")
    if key not in ("cpu", "cuda"):
        raise TrainInputError(f"--device must be auto, cpu or cuda, got {device!r}")
    return torch.device(key)


def _segments(runner: GraphRunner, requested: int | None, on_cuda: bool) -> int:
    if requested is None:
        requested = 0 if on_cuda else 1
    if requested == 0:  # auto: about two LayerNorms (one transformer block) per piece
        return max(2, runner.max_segments() // 2)
    return max(1, int(requested))


def _probe_step(torch: Any, dev: Any, batch: int, n: int, batch_tensors: Callable, forward_loss: Callable,
                lora: dict[str, Any]) -> int:
    """Peak bytes of one forward/backward at ``batch`` (CUDA), on copies of the LoRA."""
    tensors = {k: v.detach().clone().requires_grad_(True) for k, v in lora.items()}
    index = torch.arange(batch) % n
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    try:
        x, view, y = batch_tensors(index, torch.zeros(batch, dtype=torch.bool))
        forward_loss(x, view, y, tensors).backward()
        torch.cuda.synchronize(dev)
        return int(torch.cuda.max_memory_allocated(dev))
    except torch.cuda.OutOfMemoryError:
        raise MemoryError(f"batch {batch}") from None
    finally:
        del tensors
        torch.cuda.empty_cache()


def _auto_batch(torch: Any, dev: Any, n: int, max_memory_gb: float | None, probe: Callable[[int], int]) -> int:
    cap = min(n, MAX_AUTO_BATCH)
    if dev.type != "cuda":
        return min(n, CPU_AUTO_BATCH)
    if max_memory_gb is None:
        free, _total = torch.cuda.mem_get_info(dev)
        limit = int(0.9 * (free + torch.cuda.memory_allocated(dev)))
    else:
        limit = int(max_memory_gb * 2**30)
    return find_batch_size(probe, cap, limit)


class _NoBar:
    def set_postfix(self, **_: Any) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _bar(total: int, progress: bool) -> Any:
    if not progress:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)


def _progress(items: list, progress: bool, desc: str) -> Any:
    if not progress:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="img", file=sys.stderr, leave=False, dynamic_ncols=True)
