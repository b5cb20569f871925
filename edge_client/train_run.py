"""The training loop of `edge-client train` proper, torch loaded: one run's steps in order.

``edge_client.train.train_local`` checks the data, the options and where the results go, holds the
bundle's lock and loads torch; ``TrainingRun`` then prepares the device and the program (autocast,
checkpoint segments), the decoded images and the LoRA to train, picks the batch size, runs the
epochs (the FedMVP objective, ``fedmvp_formats.objective``), bounds the delta under ``[privacy]``
and builds the update's bytes, checked as its reader would. Nothing here writes a file.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from fedmvp_formats.objective import fedmvp_objective
from fedmvp_formats.privacy import LOCAL, PrivacyRecord, privatise

from edge_client.batch_fit import auto_batch, probe_step
from edge_client.bundle import Bundle
from edge_client.local_data import LocalDataset, decode_dataset, images_digest
from edge_client.lora_store import ActiveLora, active_lora, bundle_lora
from edge_client.program import load_runner
from edge_client.safetensors_check import load_safetensors
from edge_client.train_options import TrainingError, TrainInputError, TrainOptions
from edge_client.update import Base, UpdateError, update_bytes


class TrainingRun:
    """One training run, torch loaded: the device and the program, the images on the host, the LoRA
    being trained (``prepare``), then its steps in order (``batch_size``, ``epochs``, ``privatised``,
    ``update``)."""

    def __init__(self, torch: Any, bundle: Bundle, dataset: LocalDataset, o: TrainOptions, alpha: float) -> None:
        self.torch, self.bundle, self.dataset, self.o, self.alpha = torch, bundle, dataset, o, alpha

    def prepare(self, initial: ActiveLora | None, progress: bool) -> None:
        """The device, its autocast and checkpoint segments; the decoded images; the frozen weights on the
        device and the LoRA to train (``initial``, else ``o.start``'s) with gradients."""
        import torch.nn.functional as functional  # torch is loaded: the caller passed it

        torch, bundle, o = self.torch, self.bundle, self.o
        self.functional = functional
        self.dev = dev = _device(torch, o.device)
        self.on_cuda = on_cuda = dev.type == "cuda"
        self.use_autocast = on_cuda if o.autocast is None else bool(o.autocast)
        self.amp_dtype = None
        if self.use_autocast:
            self.amp_dtype = torch.bfloat16 if (not on_cuda or torch.cuda.is_bf16_supported()) else torch.float16
        self.runner, self.program, self.program_note = load_runner(bundle, o.program)
        if self.program_note is not None:  # the fallback says so, in one line (docs/howto/torchscript.md)
            print(self.program_note, file=sys.stderr, flush=True)
        self.segments = _segments(self.runner, o.checkpoint_segments, on_cuda)
        self.pixels_u8, self.labels_np = decode_dataset(self.dataset, bundle.preprocess, max_pixels=o.max_pixels,
                                                        progress=progress)
        self.n = len(self.labels_np)
        self.weights = {k: v.to(dev) for k, v in sorted(load_safetensors(bundle.file("weights"), framework="pt").items())}
        self.initial = initial if initial is not None else (
            active_lora(bundle) if o.start == "active" else bundle_lora(bundle))
        self.lora = {k: torch.tensor(np.asarray(v, np.float32), device=dev).requires_grad_(True)
                     for k, v in sorted(self.initial.tensors.items())}
        spec = bundle.preprocess
        self.mean = torch.tensor(spec.mean, dtype=torch.float32, device=dev).view(1, 3, 1, 1)
        self.std = torch.tensor(spec.std, dtype=torch.float32, device=dev).view(1, 3, 1, 1)
        self.pixels = torch.from_numpy(self.pixels_u8)  # [N, S, S, 3] uint8 on the host
        self.labels = torch.from_numpy(self.labels_np)

    def batch_tensors(self, index: Any, flip: Any) -> tuple[Any, Any, Any]:
        """One batch on the device: normalised pixels, their consistency view, the labels."""
        x = self.pixels[index].to(self.dev, non_blocking=True).permute(0, 3, 1, 2).float().div_(255.0)
        x = (x - self.mean) / self.std
        view = self.torch.where(flip.to(self.dev).view(-1, 1, 1, 1), x.flip(-1), x)
        return x, view, self.labels[index].to(self.dev)

    def forward_loss(self, x: Any, view: Any, y: Any, tensors: dict[str, Any]) -> Any:
        """The FedMVP objective of one batch (``fedmvp_formats.objective``) under the run's autocast."""
        with self.torch.autocast(self.dev.type, dtype=self.amp_dtype, enabled=self.use_autocast):
            features, logits, frozen = self.runner(x, view, tensors, self.weights, segments=self.segments)
        return fedmvp_objective(features, logits, frozen, y, self.alpha, self.functional)["loss"]

    def batch_size(self) -> int:
        """``o.batch_size``, at most the images there are; "auto": the largest that fits (``batch_fit``)."""
        torch, o, n = self.torch, self.o, self.n
        if o.batch_size == "auto":
            return auto_batch(torch, self.dev, n, o.max_memory_gb, lambda b: probe_step(
                torch, self.dev, b, n, self.batch_tensors, self.forward_loss, self.lora))
        return min(int(o.batch_size), n)

    def optimiser(self) -> tuple[Any, Any]:
        """SGD (or AdamW) over the LoRA, and fp16's gradient scaler (None otherwise)."""
        torch, o, params = self.torch, self.o, list(self.lora.values())
        opt = torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay) \
            if o.optimizer == "sgd" else torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay)
        fp16 = self.use_autocast and self.on_cuda and self.amp_dtype == torch.float16
        return opt, torch.amp.GradScaler("cuda") if fp16 else None

    def epochs(self, batch: int, generator: Any, progress: bool,
               on_step: Callable[[int, float], None] | None) -> tuple[list[float], float, int]:
        """``o.epochs`` passes over the images in a seeded order: (each epoch's mean loss, the loss summed
        over every image seen, the images seen). A loss that is not finite stops it (`TrainingError`)."""
        torch, n = self.torch, self.n
        opt, scaler = self.optimiser()
        bar = _bar(self.o.epochs * math.ceil(n / batch), progress)
        epoch_losses: list[float] = []
        total_loss, total_seen, step = 0.0, 0, 0
        flip_prob = float(self.bundle.method["flip_prob"])  # the consistency view, as the server trained it
        try:
            for _epoch in range(self.o.epochs):
                order = torch.randperm(n, generator=generator)
                flips = torch.rand(n, generator=generator) < flip_prob
                epoch_sum, epoch_seen = 0.0, 0
                for first in range(0, n, batch):
                    index = order[first:first + batch]
                    step += 1
                    value = self.step(index, flips[index], opt, scaler, step)
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
        return epoch_losses, total_loss, total_seen

    def step(self, index: Any, flip: Any, opt: Any, scaler: Any, step: int) -> float:
        """One optimiser step on the batch ``index``; its loss (``step``: its number, for the error line)."""
        x, view, y = self.batch_tensors(index, flip)
        opt.zero_grad(set_to_none=True)
        loss = self.forward_loss(x, view, y, self.lora)
        value = float(loss.detach())
        if not math.isfinite(value):
            raise TrainingError(f"the loss became {value} at step {step}; nothing was written (try a lower --lr)")
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        return value

    def privatised(self, privacy: PrivacyRecord | None) -> tuple[dict[str, np.ndarray], dict[str, Any] | None]:
        """The trained LoRA (float32 numpy) and, under ``privacy``, its delta bounded (and noised) before it
        exists anywhere, with what was done to it (the result's ``privacy``)."""
        trained = {k: v.detach().float().cpu().numpy() for k, v in self.lora.items()}
        if privacy is None:
            return trained, None
        initial = self.initial
        reference = initial.tensors if initial.source == "global" else bundle_lora(self.bundle).tensors
        trained, norm = privatise(trained, reference, privacy)
        if norm == 0.0:  # the post-step weight check Opacus users had to add: a DP round must move the LoRA
            raise TrainingError("the LoRA did not change in training (its delta is 0); nothing was written")
        return trained, {"mode": privacy.mode, "clip_norm": privacy.clip_norm, "delta_norm": norm,
                         "clipped": norm > privacy.clip_norm, "noised": privacy.mode == LOCAL}

    def update(self, trained: dict[str, np.ndarray], began: float, epoch_losses: list[float],
               mean_loss: float) -> tuple[bytes, dict[str, Any]]:
        """The update's bytes (checked as its reader would) and what the result reports of the run;
        nothing is written."""
        o, bundle, dataset, initial, n = self.o, self.bundle, self.dataset, self.initial, self.n
        seconds = time.perf_counter() - began
        try:  # the checks an update file's reader makes, on the tensors in memory
            base = Base.of_round(bundle, initial.round, initial.tensors) \
                if initial.source == "global" and initial.round is not None else None  # None: the bundle's
            data = update_bytes(trained, bundle=bundle, num_examples=n, mean_loss=mean_loss, base=base,
                                final_loss=epoch_losses[-1], epochs=o.epochs, train_seconds=round(seconds, 3),
                                classes=dataset.classes, device=self.dev.type, alpha=self.alpha, lr=o.lr,
                                optimizer=o.optimizer, started_from=initial.source,
                                images_digest=images_digest(self.pixels_u8, self.labels_np))  # docs/howto/ingest.md
        except UpdateError as err:
            raise TrainingError(f"{err}; nothing was written") from None
        return data, {"bundle": bundle.path, "num_examples": n, "classes": dataset.classes, "epochs": o.epochs,
                      "device": str(self.dev), "mean_loss": mean_loss, "final_loss": epoch_losses[-1],
                      "epoch_losses": epoch_losses, "seconds": seconds, "alpha": self.alpha, "lr": o.lr,
                      "optimizer": o.optimizer, "started_from": initial.source, "skipped": list(dataset.skipped),
                      "autocast": str(self.amp_dtype).replace("torch.", "") if self.use_autocast else None,
                      "checkpoint_segments": len(self.runner.plan(self.segments)), "program": self.program,
                      "program_note": self.program_note}


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


def _segments(runner: Any, requested: int | None, on_cuda: bool) -> int:
    """Checkpointed pieces to cut the graph into: none on CPU, one block per piece on CUDA (a `GraphRunner`;
    a TorchScript module's runner has one piece whatever is asked)."""
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
