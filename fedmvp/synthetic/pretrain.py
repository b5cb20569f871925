"""Pretraining the tiny CLIP (``fedmvp-tiny``) on the synthetic world: the shipped weights.

Why: no pretrained CLIP can be fetched offline, so fedmvp ships one it made itself. Images
come from an infinite, seeded stream of the renderer; captions describe SEEN classes only,
mixing made-up names, attribute descriptions and the exact attribute-sentence format, with
domain words ("a sketch of a zorblin", "a photo of a red striped circle", "a photo of a
zorblin, which has a bright red colour"). Held-out compositions are never captioned by name,
but every attribute value they use is, so attribute sentences can carry them at test time.

Loss: CLIP's symmetric contrastive loss with multiple positives: a caption that is true of
several images in the batch ("a photo of a red object") counts as a positive for all of them,
instead of pushing true matches apart as plain CLIP would.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedmvp.attributes.sentences import SentenceStyle, sentence
from fedmvp.synthetic.render import image_rng, render
from fedmvp.synthetic.world import (WorldClass, article, class_phrases, load_classes, made_up_words,
                               seen_classes, world_texts)

MODEL_NAME = "fedmvp-tiny"
PRETRAIN_STREAM = 7_000_001  # seed-sequence key: pretraining images never collide with the written world
# The domains the shipped weights saw; night and fog (world.DOMAINS) stay unseen on purpose.
PRETRAIN_DOMAINS = ("photo", "sketch", "painting")
ATTRIBUTE_ORDER = ("size", "colour", "pattern", "shape")
# Which attributes each of the 10 class phrases (world.class_phrases) talks about.
PHRASE_ATTRIBUTES = (("shape",), ("shape",), ("colour",), ("colour",), ("pattern",), ("pattern",), ("size",),
                     ("colour", "pattern"), ("colour", "shape"), ATTRIBUTE_ORDER)
CAPTION_KINDS = ("name", "sentence", "description", "full_description", "nonce_sentence")


@dataclass
class PretrainConfig:
    """Hyper-parameters of `fedmvp pretrain-tiny` (defaults reproduce the shipped weights)."""

    steps: int = 1300
    batch_size: int = 128
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.1
    seed: int = 0
    domain_weights: tuple[float, ...] = (0.5, 0.25, 0.25)  # photo, sketch, painting
    caption_weights: tuple[float, ...] = (0.2, 0.25, 0.25, 0.1, 0.2)  # in CAPTION_KINDS order
    threads: int = 2
    workers: int = 1  # render processes beside the training process (0: render inline)
    save_every: int = 0  # also write a snapshot <out stem>.step<N>.safetensors every N steps (0: never)


# ---- captions ----------------------------------------------------------------------------------

def describe(cls: WorldClass, attrs: tuple[str, ...]) -> str:
    """'small red striped circle' restricted to ``attrs`` ('red object' when no shape is named)."""
    words = {"size": cls.size, "colour": cls.colour, "pattern": cls.pattern_adjective, "shape": cls.shape}
    parts = [words[a] for a in ATTRIBUTE_ORDER if a in attrs]
    if "shape" not in attrs:
        parts.append("object")
    return " ".join(parts)


class CaptionSampler:
    """Draws one caption for an image of a seen class, and the constraint that makes it true."""

    def __init__(self, config: PretrainConfig):
        self.weights = np.asarray(config.caption_weights, dtype=float) / sum(config.caption_weights)
        self.nonce = made_up_words(400, seed=config.seed + 91, exclude={c.name for c in load_classes()})

    def __call__(self, cls: WorldClass, domain: str, rng: np.random.Generator) -> tuple[str, dict[str, str]]:
        style = SentenceStyle.for_domain(domain)
        kind = CAPTION_KINDS[int(rng.choice(len(CAPTION_KINDS), p=self.weights))]
        if kind == "name":
            return f"{style.prefix} {cls.name}", {"name": cls.name}
        if kind == "sentence":
            phrase = class_phrases(cls)[int(rng.integers(10))]
            return sentence(cls.name, phrase, style), {"name": cls.name}
        if kind in ("description", "full_description"):
            if kind == "full_description":
                attrs = ATTRIBUTE_ORDER
            else:
                keep = rng.random(4) < 0.5
                keep[int(rng.integers(4))] = True
                attrs = tuple(a for a, k in zip(ATTRIBUTE_ORDER, keep) if k)
            text = describe(cls, attrs)
            prefix = style.prefix.rsplit(" ", 1)[0]  # "a photo of" + a/an
            return f"{prefix} {article(text)} {text}", {a: getattr(cls, a) for a in attrs}
        i = int(rng.integers(10))
        word = self.nonce[int(rng.integers(len(self.nonce)))]
        return sentence(word, class_phrases(cls)[i], style), {a: getattr(cls, a) for a in PHRASE_ATTRIBUTES[i]}


def satisfies(cls: WorldClass, constraint: dict[str, str]) -> bool:
    return all(getattr(cls, key) == value for key, value in constraint.items())


# ---- the batch stream ----------------------------------------------------------------------------

def render_batch(step: int, config: PretrainConfig, sampler: CaptionSampler) -> dict:
    """Batch ``step`` of the stream: uint8 images, captions and the [B, B] match matrix."""
    rng = image_rng(config.seed, PRETRAIN_STREAM, step)
    classes = seen_classes()
    dweights = np.asarray(config.domain_weights, dtype=float) / sum(config.domain_weights)
    images, captions, picked, constraints = [], [], [], []
    for _ in range(config.batch_size):
        cls = classes[int(rng.integers(len(classes)))]
        domain = PRETRAIN_DOMAINS[int(rng.choice(len(PRETRAIN_DOMAINS), p=dweights))]
        images.append(np.asarray(render(cls, domain, rng)))
        text, constraint = sampler(cls, domain, rng)
        captions.append(text)
        picked.append(cls)
        constraints.append(constraint)
    match = torch.tensor([[satisfies(c, k) for k in constraints] for c in picked], dtype=torch.bool)
    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()
    return {"step": step, "images": pixels, "captions": captions, "match": match}


class BatchStream(torch.utils.data.IterableDataset):
    """Batches ``start..steps-1`` in order; each worker renders every n-th step (order kept by DataLoader)."""

    def __init__(self, config: PretrainConfig, start: int = 0):
        self.config, self.start = config, start

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        sampler = CaptionSampler(self.config)
        for step in range(self.start + wid, self.config.steps, nw):
            yield render_batch(step, self.config, sampler)


def batches(config: PretrainConfig) -> Iterator[dict]:
    stream = BatchStream(config)
    if config.workers <= 0:
        return iter(stream)
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=config.workers,
                                         prefetch_factor=4, persistent_workers=False)
    return iter(loader)


# ---- model, loss, optimiser ----------------------------------------------------------------------

def multi_positive_clip_loss(image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
                             match: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE whose targets spread over every true (image, caption) pair."""
    logits = logit_scale * image_features @ text_features.T
    target = match.float()
    i2t = -(target / target.sum(1, keepdim=True) * F.log_softmax(logits, 1)).sum(1).mean()
    t2i = -(target / target.sum(0, keepdim=True) * F.log_softmax(logits, 0)).sum(0).mean()
    return (i2t + t2i) / 2


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    def exempt(name: str, p: nn.Parameter) -> bool:  # open_clip's rule
        return p.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if exempt(n, p)], "weight_decay": 0.0},
            {"params": [p for n, p in named if not exempt(n, p)], "weight_decay": weight_decay}]


def lr_at(step: int, config: PretrainConfig) -> float:
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return 0.5 * config.lr * (1 + math.cos(math.pi * progress))


def normaliser(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """uint8 [B, 3, H, W] -> the tensors open_clip's preprocess would give (images are already H = W = 32)."""
    cfg = getattr(model.visual, "preprocess_cfg", {}) or {}
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

    mean = torch.tensor(cfg.get("mean", OPENAI_DATASET_MEAN)).view(1, 3, 1, 1)
    std = torch.tensor(cfg.get("std", OPENAI_DATASET_STD)).view(1, 3, 1, 1)
    return lambda x: (x.float() / 255.0 - mean) / std


def write_vocab(path: Path) -> int:
    """Regenerate the compact tokenizer's kept-ids file from every text of the world."""
    from fedmvp.atomic import write_text
    from fedmvp.tiny_tokenizer import CompactTokenizer

    ids = CompactTokenizer.kept_ids_for(world_texts())
    doc = ("BPE ids kept by the fedmvp-tiny tokenizer: every token of the synthetic world's texts. "
           "Regenerate with `fedmvp pretrain-tiny --write-vocab`.")
    write_text(path, json.dumps({"_doc": doc, "bpe_ids": ids}) + "\n")
    return len(ids)


def pretrain(config: PretrainConfig, out: Path, progress: bool = True,
             on_step: Callable[[int, float], None] | None = None) -> dict:
    """Train fedmvp-tiny from scratch and write fp16 safetensors atomically to ``out``."""
    from fedmvp.atomic import save_safetensors
    from fedmvp.clip import load_clip

    torch.set_num_threads(max(1, config.threads))
    torch.manual_seed(config.seed)
    clip = load_clip(MODEL_NAME, None)
    model, tokenizer = clip.model, clip.tokenizer
    for p in model.parameters():
        p.requires_grad_(True)
    model.train()
    opt = torch.optim.AdamW(_param_groups(model, config.weight_decay), lr=config.lr, betas=(0.9, 0.98), eps=1e-6)
    norm = normaliser(model)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=config.steps, desc="pretrain fedmvp-tiny", unit="step")
    losses: list[float] = []
    ema = None
    for batch in batches(config):
        step = int(batch["step"])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, config)
        image_f, text_f, scale = model(norm(batch["images"]), tokenizer(batch["captions"]))
        loss = multi_positive_clip_loss(image_f, text_f, scale, batch["match"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        value = loss.item()
        losses.append(value)
        ema = value if ema is None else 0.98 * ema + 0.02 * value
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{ema:.3f}", scale=f"{scale.item():.1f}")
        if on_step is not None:
            on_step(step, value)
        if config.save_every and (step + 1) % config.save_every == 0 and step + 1 < config.steps:
            snapshot = Path(out).with_name(f"{Path(out).stem}.step{step + 1}{Path(out).suffix}")
            save_safetensors({k: v.detach().to(torch.float16) for k, v in model.state_dict().items()}, snapshot)
    if bar is not None:
        bar.close()
    model.eval()
    state = {k: v.detach().to(torch.float16) for k, v in model.state_dict().items()}
    meta = {"model": MODEL_NAME, "config": json.dumps(asdict(config)), "final_loss": f"{ema:.4f}",
            "format": "open_clip state dict, fp16"}
    save_safetensors(state, out, metadata=meta)
    return {"out": str(out), "steps": len(losses), "final_loss": ema,
            "params": sum(p.numel() for p in model.parameters()), "bytes": Path(out).stat().st_size}
