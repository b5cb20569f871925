"""What a worker process builds once and every client it serves uses: the task context, local training.

A worker process (a Ray actor in simulation, a SuperNode in deployment, the ServerApp's own
process for evaluation) builds ONE context per (preset, method, device): the frozen CLIP is
loaded once, the federation's data (a site's process: its own) is indexed once (``load_federation``), images and frozen
consistency targets are cached, attribute text features are computed once per class set.
The model is built from the run's method record (``FedMVPConfig``) by ``FedMVP.build``, the same
seed-CLIP-method sequence as ``FedMVP.from_run``, never from defaults.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, fields
from functools import lru_cache

import torch

from fedmvp_formats.messages import MessageError

from fedmvp.attributes.cache import TextFeatureCache
from fedmvp.attributes.sentences import build_sentences
from fedmvp.clip import LoadedClip
from fedmvp.data.dataset import stack_samples
from fedmvp.federated.seeds import derived_seed
from fedmvp.model import FedMVP, FedMVPConfig, autocast_for

Samples = list[tuple[str, int]]


@dataclass(frozen=True)
class LocalSettings:
    """A client's round settings, sent by the server from the run record (docs/method.md §4, §6)."""

    local_epochs: int
    batch_size: int
    momentum: float
    weight_decay: float
    sigma: float

    def to_record(self) -> dict[str, int | float]:
        """The message's ``local`` record (``fedmvp_formats.messages``)."""
        return dict(self.__dict__)

    @classmethod
    def from_record(cls, record: dict) -> "LocalSettings":
        """From the message's ``local`` record: exactly these fields, integers and numbers as sent."""
        names = [f.name for f in fields(cls)]
        if sorted(record) != sorted(names):
            raise MessageError(f"the local record holds {sorted(record)}, not {names}")
        for name in names:
            value, kind = record[name], int if name in ("local_epochs", "batch_size") else (int, float)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise MessageError(f"local {name} {value!r} is not {'an integer' if kind is int else 'a number'}")
        return cls(**record)

    @classmethod
    def from_train(cls, train: dict) -> "LocalSettings":
        """From the run record's ``train`` table."""
        return cls(local_epochs=int(train["local_epochs"]), batch_size=int(train["batch_size"]),
                   momentum=float(train["momentum"]), weight_decay=float(train["weight_decay"]),
                   sigma=float(train["sigma"]))


@dataclass
class TaskContext:
    """Everything a worker process builds once per preset and method."""

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

    def client(self, client_id: int):
        for client in self.federation.clients:
            if client.client_id == client_id:
                return client
        raise KeyError(f"no client {client_id} in this federation ({len(self.federation.clients)} clients)")


def task_context(preset_path: str, method: FedMVPConfig, device: str = "cpu", site=None) -> TaskContext:
    """The process's context for this preset and method (built on first use); ``site`` (a
    ``SiteRequest``): only that site's data is built (a site's process), else the whole federation."""
    return _task_context(preset_path, json.dumps(method.to_dict(), sort_keys=True), device, site)


@lru_cache(maxsize=2)
def _task_context(preset_path: str, method_json: str, device: str, site) -> TaskContext:
    from fedmvp.data.federation import load_federation

    preset, federation = load_federation(preset_path, site)
    model = FedMVP.build(preset.model.clip, preset.model.pretrained, FedMVPConfig.from_dict(json.loads(method_json)),
                         preset.seed, device)  # the one rebuild's first half (FedMVP.from_run adds a round)
    return TaskContext(preset=preset, federation=federation, clip=model.clip_info, model=model,
                       device=torch.device(device))


def train_class_counts(client) -> dict[str, int]:
    """A client's training images per class, in its class order: what its train reply's ``classes``
    record says and the server records per site (they add up to the reply's examples, ``len(train)``)."""
    counts = Counter(client.class_names[label] for _, label in client.train)
    return {name: counts[name] for name in client.class_names}


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
                lr: float, lora_active: bool, settings: LocalSettings) -> LocalResult:
    """One client's round (docs/method.md §4-6): epochs of SGD steps, mean loss, the switch rule."""
    model = ctx.model
    model.load_state(global_state)
    model.set_lora_mode(lora_active)
    model.set_text_features(ctx.text_features(client.class_names, client.attributes, client.style))
    images, labels = ctx.images(f"train/{client.client_id}", client.train)
    targets = ctx.frozen_targets(f"train/{client.client_id}", images) if model.config.alpha > 0 else None
    optimizer = torch.optim.SGD(model.trainable_parameters(), lr=lr, momentum=settings.momentum,
                                weight_decay=settings.weight_decay)
    generator = torch.Generator().manual_seed(derived_seed(ctx.preset.seed, round_number, client.client_id))
    model.train()
    totals = {"loss": 0.0, "ce": 0.0, "consistency": 0.0}
    seen = 0
    for _ in range(settings.local_epochs):
        order = torch.randperm(len(images), generator=generator)
        for start in range(0, len(order), settings.batch_size):
            idx = order[start:start + settings.batch_size]
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
    switch_next = (not lora_active) and model.config.use_lora and means["loss"] < settings.sigma
    return LocalResult(state=model.state("trainable"), num_examples=len(images), loss=means["loss"],
                       ce=means["ce"], consistency=means["consistency"], lora_active=lora_active,
                       switch_next=switch_next)
