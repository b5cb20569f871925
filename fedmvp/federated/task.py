"""What client and server share: the per-process context, local training, evaluation, tensor transport.

A worker process (a Ray actor in simulation, a SuperNode in deployment) builds ONE
context per preset: the frozen CLIP is loaded once, the federation's data is indexed
once, images and frozen consistency targets are cached, attribute text features are
computed once per class set. Every client the process serves re-uses them.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from fedmvp.attributes.cache import TextFeatureCache
from fedmvp.attributes.sentences import build_sentences
from fedmvp.clip import LoadedClip, load_clip
from fedmvp.data.dataset import stack_samples
from fedmvp.model import FedMVP, FedMVPConfig, autocast_for

Samples = list[tuple[str, int]]


def derived_seed(*parts: object) -> int:
    """A stable 63-bit seed from (run seed, round, client, ...): resume replays the same randomness."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def cosine_lr(base_lr: float, round_number: int, total_rounds: int) -> float:
    """Cosine decay over the rounds (round 1 uses base_lr)."""
    if total_rounds <= 1:
        return base_lr
    return 0.5 * base_lr * (1 + math.cos(math.pi * (round_number - 1) / total_rounds))


def harmonic_mean(values: list[float]) -> float:
    if any(v <= 0 for v in values):
        return 0.0
    return len(values) / sum(1.0 / v for v in values)


# ---- tensors on the wire ------------------------------------------------------------------------
def to_numpy_state(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().float().numpy() for k, v in state.items()}


def to_torch_state(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(v, dtype=np.float32, copy=True)) for k, v in arrays.items()}


def weighted_average(replies: list[tuple[dict[str, np.ndarray], float]]) -> dict[str, np.ndarray]:
    """Per-tensor FedAvg weighted by examples over the clients that SENT that tensor.

    LoRA-only clients send only ``lora.*``; full clients send ``promptformer.*``; a tensor
    nobody sent is absent from the result (the caller keeps the previous global value).
    """
    sums: dict[str, np.ndarray] = {}
    weights: dict[str, float] = {}
    for arrays, weight in replies:
        for key, value in arrays.items():
            contribution = np.asarray(value, dtype=np.float64) * weight
            sums[key] = sums[key] + contribution if key in sums else contribution
            weights[key] = weights.get(key, 0.0) + weight
    return {k: (sums[k] / weights[k]).astype(np.float32) for k in sums}


# ---- the per-process context ----------------------------------------------------------------------
@dataclass
class TaskContext:
    """Everything a worker process builds once per preset."""

    preset: object
    federation: object
    clip: LoadedClip
    model: FedMVP
    device: torch.device
    text_cache: TextFeatureCache = field(default_factory=TextFeatureCache)
    _images: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _targets: dict[str, torch.Tensor] = field(default_factory=dict)

    def images(self, key: str, samples: Samples) -> tuple[torch.Tensor, torch.Tensor]:
        if key not in self._images:
            self._images[key] = stack_samples(samples, self.clip.preprocess)
        return self._images[key]

    def text_features(self, class_names: list[str], attributes: dict[str, list[str]], style) -> torch.Tensor:
        return self.text_cache.class_features(self.clip, build_sentences(class_names, attributes, style))

    def frozen_targets(self, key: str, images: torch.Tensor) -> torch.Tensor:
        """[2, N, E]: frozen CLIP features of each image and of its flip, computed once.

        The consistency view is a per-sample flip, so every target is one of these two."""
        if key not in self._targets:
            feats = []
            for view in (images, images.flip(-1)):
                chunks = [self.model.encode_frozen(view[i:i + 256].to(self.device)).cpu()
                          for i in range(0, len(view), 256)]
                feats.append(torch.cat(chunks) if chunks else torch.zeros(0))
            self._targets[key] = torch.stack(feats)
        return self._targets[key]


def model_config(preset) -> FedMVPConfig:
    train = preset.train
    return FedMVPConfig(num_prompts=train.num_prompts, alpha=train.alpha, use_lora=train.use_lora)


def build_model(clip: LoadedClip, preset, device: torch.device) -> FedMVP:
    """The global model's initial state is a function of the preset's seed alone."""
    torch.manual_seed(preset.seed)
    return FedMVP(clip, model_config(preset)).to(device)


@lru_cache(maxsize=2)
def task_context(preset_path: str, device: str = "cpu") -> TaskContext:
    """Built once per process and preset (the frozen CLIP is loaded once per worker, not per client)."""
    from fedmvp.data.federation import build_federation
    from fedmvp.presets.schema import load_preset

    preset = load_preset(preset_path)
    federation = build_federation(preset)
    torch_device = torch.device(device)
    torch.manual_seed(preset.seed)  # a random-init backbone must be the same in every process
    clip = load_clip(preset.model.clip, preset.model.pretrained or None, device=torch_device)
    return TaskContext(preset=preset, federation=federation, clip=clip,
                       model=build_model(clip, preset, torch_device), device=torch_device)


def client_by_id(ctx: TaskContext, client_id: int):
    for client in ctx.federation.clients:
        if client.client_id == client_id:
            return client
    raise KeyError(f"no client {client_id} in this federation")


# ---- local training -------------------------------------------------------------------------------
@dataclass
class LocalResult:
    state: dict[str, torch.Tensor]  # what the client sends (PromptFormer or LoRA tensors)
    num_examples: int
    loss: float
    ce: float
    consistency: float
    lora_active: bool  # trained and sent LoRA only
    switch_next: bool  # mean loss fell below sigma: LoRA only from the next round on


def local_train(ctx: TaskContext, client, global_state: dict[str, torch.Tensor], round_number: int,
                lr: float, lora_active: bool) -> LocalResult:
    """One client's round (SPEC sections 4-6): epochs of SGD steps, mean loss, the switch rule."""
    train = ctx.preset.train
    model = ctx.model
    model.load_state(global_state)
    model.set_lora_mode(lora_active)
    model.set_text_features(ctx.text_features(client.class_names, client.attributes, client.style))
    images, labels = ctx.images(f"train/{client.client_id}", client.train)
    targets = ctx.frozen_targets(f"train/{client.client_id}", images) if train.alpha > 0 else None
    optimizer = torch.optim.SGD(model.trainable_parameters(), lr=lr, momentum=train.momentum,
                                weight_decay=train.weight_decay)
    generator = torch.Generator().manual_seed(derived_seed(ctx.preset.seed, round_number, client.client_id))
    model.train()
    totals = {"loss": 0.0, "ce": 0.0, "consistency": 0.0}
    seen = 0
    for _ in range(train.local_epochs):
        order = torch.randperm(len(images), generator=generator)
        for start in range(0, len(order), train.batch_size):
            idx = order[start:start + train.batch_size]
            batch_targets = None
            if targets is not None:
                flips = (torch.rand(len(idx), generator=generator) < model.config.flip_prob).long()
                batch_targets = targets[flips, idx].to(ctx.device)
            optimizer.zero_grad(set_to_none=True)
            with autocast_for(ctx.device):
                out = model.loss(images[idx].to(ctx.device), labels[idx].to(ctx.device), batch_targets)
            out["loss"].backward()
            optimizer.step()
            for key in totals:
                totals[key] += float(out[key].detach()) * len(idx)
            seen += len(idx)
    model.eval()
    means = {k: v / max(seen, 1) for k, v in totals.items()}
    switch_next = (not lora_active) and model.config.use_lora and means["loss"] < train.sigma
    return LocalResult(state=model.state("trainable"), num_examples=len(images), loss=means["loss"],
                       ce=means["ce"], consistency=means["consistency"], lora_active=lora_active,
                       switch_next=switch_next)


# ---- evaluation -----------------------------------------------------------------------------------
@torch.no_grad()
def accuracy(ctx: TaskContext, key: str, samples: Samples, text_features: torch.Tensor,
             prompted: bool = True, batch_size: int = 256) -> tuple[int, int]:
    """(correct, total) of the global model (or the frozen CLIP when ``prompted`` is False)."""
    model = ctx.model
    images, labels = ctx.images(key, samples)
    model.set_text_features(text_features)
    model.eval()
    correct = 0
    for start in range(0, len(images), batch_size):
        batch = images[start:start + batch_size].to(ctx.device)
        with autocast_for(ctx.device):
            feats = model.encode(batch) if prompted else model.encode_frozen(batch)
            logits = model.logits(feats.float())
        correct += int((logits.argmax(-1).cpu() == labels[start:start + batch_size]).sum())
    return correct, len(images)


def evaluate_global(ctx: TaskContext, global_state: dict[str, torch.Tensor] | None) -> dict[str, float]:
    """SPEC section 7: Local (each client, own classes), Base, New (label subsets), HM of the three.

    ``global_state`` None evaluates the frozen CLIP (zero-shot) with the same classifier."""
    prompted = global_state is not None
    if prompted:
        ctx.model.load_state(global_state)
        ctx.model.set_lora_mode(False)
    local = []
    for client in ctx.federation.clients:
        feats = ctx.text_features(client.class_names, client.attributes, client.style)
        c, n = accuracy(ctx, f"test/{client.client_id}", client.test, feats, prompted)
        if n:
            local.append(c / n)
    results: dict[str, list[float]] = {"base": [], "new": [], "domain": []}
    for ev in ctx.federation.evaluations:
        feats = ctx.text_features(ev.class_names, ev.attributes, ev.style)
        c, n = accuracy(ctx, f"eval/{ev.kind}/{ev.dataset}/{ev.domain}", ev.samples, feats, prompted)
        if n:
            results[ev.kind].append(c / n)
    mean = lambda xs: float(sum(xs) / len(xs)) if xs else None  # noqa: E731
    metrics = {"local": mean(local), "base": mean(results["base"]), "new": mean(results["new"]),
               "domain": mean(results["domain"])}
    parts = [metrics[k] for k in ("local", "base", "new") if metrics[k] is not None]
    metrics["hm"] = harmonic_mean(parts) if parts else None
    return metrics


def preset_file(run_path: Path) -> Path:
    return run_path / "preset.toml"
