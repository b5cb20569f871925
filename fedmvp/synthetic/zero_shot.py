"""Zero-shot top-1 of a CLIP on the synthetic world, the way the method classifies.

Why: the shipped tiny CLIP must be measured (docs/tiny-clip.md figures, a drift test) with the
classifier FedMVP itself uses (docs/method.md §2): t_ck = normalize(E_text(sentence_ck)),
logit_c = s * mean_k cos(f_img, t_ck), i.e. the image feature against the UN-renormalised
mean of the class's sentence features. "name" prompts are the one-sentence case
("a photo of a zorblin"); "attributes" prompts are the 10 attribute sentences per class.
Seen and held-out compositions are scored as separate label spaces (48-way and 16-way).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image

from fedmvp.attributes.sentences import SentenceStyle, build_sentences
from fedmvp.clip import LoadedClip
from fedmvp.synthetic.world import DOMAINS

GROUPS = ("seen", "held_out")
PROMPTS = ("name", "attributes")


@torch.no_grad()
def class_text_weights(clip: LoadedClip, prompts: list[list[str]], batch: int = 256) -> torch.Tensor:
    """[C, D]: mean over each class's prompts of the normalised text features (not renormalised)."""
    flat = [p for row in prompts for p in row]
    feats = torch.cat([F.normalize(clip.model.encode_text(clip.tokenizer(flat[i:i + batch])).float(), dim=-1)
                       for i in range(0, len(flat), batch)])
    k = len(prompts[0])
    if any(len(row) != k for row in prompts):
        raise ValueError("every class needs the same number of prompts")
    return feats.view(len(prompts), k, -1).mean(1)


@torch.no_grad()
def image_features(clip: LoadedClip, paths: list[Path], batch: int = 256) -> torch.Tensor:
    out = []
    for i in range(0, len(paths), batch):
        pixels = torch.stack([clip.preprocess(Image.open(p).convert("RGB")) for p in paths[i:i + batch]])
        out.append(F.normalize(clip.model.encode_image(pixels).float(), dim=-1))
    return torch.cat(out)


def top1(feats: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> float:
    """Top-1 accuracy in percent (the logit scale does not change the argmax)."""
    return float(((feats @ weights.T).argmax(1) == labels).float().mean() * 100)


def world_split(root: Path, domain: str, split: str, class_names: list[str]) -> tuple[list[Path], torch.Tensor]:
    """Image paths and labels (index into ``class_names``) of one domain/split of a written world."""
    paths, labels = [], []
    for label, name in enumerate(class_names):
        files = sorted((root / domain / split / name).glob("*.png"))
        if not files:
            raise FileNotFoundError(f"no images in {root / domain / split / name}")
        paths += files
        labels += [label] * len(files)
    return paths, torch.tensor(labels)


def world_zero_shot(clip: LoadedClip, root: str | Path, split: str = "test",
                    domains: tuple[str, ...] = DOMAINS) -> dict:
    """Zero-shot top-1 per domain x {seen, held_out} x {name, attributes}, with chance levels."""
    import json

    root = Path(root)
    world = json.loads((root / "world.json").read_text())
    attributes = {k: v for k, v in json.loads((root / "attributes.json").read_text()).items() if k != "_meta"}
    groups = {"seen": world["seen"], "held_out": world["held_out"]}
    results: dict = {}
    for domain in domains:
        style = SentenceStyle.for_domain(domain)
        results[domain] = {}
        for group, names in groups.items():
            paths, labels = world_split(root, domain, split, names)
            feats = image_features(clip, paths)
            name_prompts = [[f"{style.prefix} {n}"] for n in names]
            attr_prompts = build_sentences(names, attributes, style).sentences
            results[domain][group] = {
                "classes": len(names), "images": len(paths), "chance": round(100 / len(names), 2),
                "name": round(top1(feats, labels, class_text_weights(clip, name_prompts)), 2),
                "attributes": round(top1(feats, labels, class_text_weights(clip, attr_prompts)), 2),
            }
    return {"model": clip.name, "pretrained": clip.pretrained, "split": split,
            "world": {"seed": world["seed"], "version": world["version"], "splits": world["splits"]},
            "results": results}


def format_table(report: dict) -> str:
    """A markdown table of ``world_zero_shot``'s results."""
    lines = ["| domain | classes | chance | name only | attribute sentences |",
             "|---|---|---|---|---|"]
    for domain, groups in report["results"].items():
        for group, r in groups.items():
            label = "seen" if group == "seen" else "held-out"
            lines.append(f"| {domain} | {r['classes']} {label} | {r['chance']:.1f} | {r['name']:.1f} | "
                         f"{r['attributes']:.1f} |")
    return "\n".join(lines)
