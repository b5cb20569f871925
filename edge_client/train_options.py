"""The options of on-device training, in one place: `train_local` and `edge-client train` share them.

No torch and no training code here, so the command line takes its defaults and help from
this module at import time. Each field carries ``metadata={"help": ...}``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

from edge_client.images import DEFAULT_MAX_PIXELS

# sgd: the method's optimiser (docs/method.md §6: momentum, weight decay); adamw: decoupled
# weight decay, the usual LoRA optimiser, which still learns where the gradients reaching the
# LoRA are tiny (a small CLIP with B near 0).
OPTIMIZERS = ("sgd", "adamw")
STARTS = ("active", "bundle")
DEVICES = ("auto", "cpu", "cuda")
# What training runs through (edge_client.program.load_runner): train.pt2, or the TorchScript training module
# (train.torchscript.pt, bundles exported with --format torchscript); auto: train.pt2 unless this torch cannot
# load it (docs/howto/torchscript.md).
PROGRAMS = ("auto", "pt2", "torchscript")


class TrainInputError(ValueError):
    """Bad local data or options (unknown class, no images, ...): nothing was trained."""


class TrainingError(RuntimeError):
    """Training could not run or diverged: nothing was written."""


@dataclass(frozen=True)
class TrainOptions:
    """How `train_local` trains; checked when built, so bad options fail before any work."""

    epochs: int = field(default=5, metadata={"help": "Local epochs."})
    batch_size: int | str = field(default="auto", metadata={
        "help": "Images per step; auto: on CUDA the largest that fits the memory limit, on CPU 32."})
    max_memory_gb: float | None = field(default=None, metadata={
        "help": "GPU memory (GiB) batch size auto may use (default: 90% of what is free)."})
    # None: keep no update file, the result's tensors are all (a federation node without --out)
    out: str | os.PathLike | None = field(default="updates", metadata={
        "help": "Directory for the update file (or a new path ending in .safetensors); never inside a bundle "
                "or run directory, never an existing file."})
    lr: float = field(default=0.003, metadata={
        "help": "Learning rate (docs/method.md §6; with adamw try 0.01)."})
    momentum: float = field(default=0.9, metadata={"help": "SGD momentum (docs/method.md §6)."})
    weight_decay: float = field(default=1e-5, metadata={
        "help": "Weight decay of either optimizer (docs/method.md §6)."})
    optimizer: str = field(default="sgd", metadata={
        "help": "sgd: the method's (docs/method.md §6); adamw: the usual LoRA optimizer, learns where the "
                "gradients reaching the LoRA are tiny (small models)."})
    alpha: float | None = field(default=None, metadata={
        "help": "Weight of the consistency loss (docs/method.md §5; default: the bundle's, manifest method.alpha)."})
    device: str = field(default="auto", metadata={"help": "Where to train (auto: CUDA when torch sees a GPU)."})
    seed: int = field(default=0, metadata={"help": "Shuffling and flip augmentation seed."})
    apply: bool = field(default=True, metadata={
        "help": "Make the result the device's active LoRA (the previous one is kept for rollback)."})
    start: str = field(default="active", metadata={
        "help": "active: continue from the LoRA the device runs (personalised if any); bundle: from the "
                "exported LoRA."})
    autocast: bool | None = field(default=None, metadata={
        "help": "Mixed precision (bf16, else fp16 with a gradient scaler); default: on for CUDA, off for CPU."})
    checkpoint_segments: int | None = field(default=None, metadata={
        "help": "Activation-checkpointed pieces the graph is cut into (0: auto); default: auto on CUDA, "
                "1 (none) on CPU."})
    max_pixels: int | None = field(default=DEFAULT_MAX_PIXELS, metadata={
        "help": "Refuse images with more pixels (decompression bombs)."})
    threads: int | None = field(default=None, metadata={
        "help": "torch CPU threads while training (restored afterwards)."})
    program: str = field(default="auto", metadata={
        "help": "What to train through: pt2 (train.pt2), torchscript (train.torchscript.pt, --format torchscript "
                "bundles; no checkpoint segments), auto: train.pt2, or the TorchScript module where this torch "
                "cannot load train.pt2."})

    def __post_init__(self) -> None:
        _check(isinstance(self.epochs, int) and self.epochs >= 1, f"epochs must be a positive int, got {self.epochs!r}")
        _check(self.start in STARTS, f"start must be 'active' or 'bundle', got {self.start!r}")
        _check((isinstance(self.batch_size, int) and self.batch_size >= 1) or self.batch_size == "auto",
               f"batch size must be 'auto' or a positive int, got {self.batch_size!r}")
        _check(self.max_memory_gb is None or self.max_memory_gb > 0,
               f"--max-memory-gb must be > 0, got {self.max_memory_gb}")
        _check(self.lr > 0 and math.isfinite(self.lr), f"learning rate must be > 0, got {self.lr}")
        _check(self.optimizer in OPTIMIZERS,
               f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        _check(self.program in PROGRAMS, f"program must be one of {', '.join(PROGRAMS)}, got {self.program!r}")
        _check(self.threads is None or (isinstance(self.threads, int) and self.threads >= 1),
               f"threads must be a positive int, got {self.threads!r}")

    @staticmethod
    def default(name: str) -> Any:
        """The default of field ``name`` (what the command line shows and uses)."""
        return _FIELDS[name].default

    @staticmethod
    def help(name: str) -> str:
        """The help text of field ``name``."""
        return str(_FIELDS[name].metadata["help"])


_FIELDS = {f.name: f for f in fields(TrainOptions)}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise TrainInputError(message)
