"""Attribute text features t_ck = normalize(E_text(sentence_ck)), computed once per class set.

The official code re-encodes every sentence on every forward pass; here features are
computed once, kept in memory, and (for weights with a stable identity) cached on disk
in safetensors keyed by model identity + tokenizer context + the exact sentences.
Random-init backbones have no identity and are cached in memory only.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from fedmvp_formats.files import cache_root

from fedmvp.atomic import save_safetensors
from fedmvp.attributes.sentences import ClassSentences
from fedmvp.clip import LoadedClip


def default_cache_dir() -> Path:
    if os.environ.get("FEDMVP_TEXT_CACHE"):
        return Path(os.environ["FEDMVP_TEXT_CACHE"])
    return cache_root() / "text-features"


class TextFeatureCache:
    """Memory + disk cache of normalised sentence features."""

    def __init__(self, directory: str | Path | None = None, use_disk: bool = True):
        self.directory = Path(directory) if directory else default_cache_dir()
        self.use_disk = use_disk
        self.memory: dict[str, torch.Tensor] = {}
        self.encoder_calls = 0  # how many times the text encoder actually ran (tests read this)

    @staticmethod
    def key(clip: LoadedClip, sentences: list[str], salt: str) -> str:
        digest = hashlib.sha256()
        for part in (clip.identity or f"random:{id(clip.model)}", salt, *sentences):
            digest.update(part.encode("utf-8") + b"\0")
        return digest.hexdigest()

    def encode(self, clip: LoadedClip, sentences: list[str], batch_size: int = 256) -> torch.Tensor:
        """[N, E] normalised features of ``sentences`` (fp32, on the model's device)."""
        salt = f"ctx={getattr(clip.tokenizer, 'context_length', '')}"
        key = self.key(clip, sentences, salt)
        device = next(clip.model.parameters()).device
        if key in self.memory:
            return self.memory[key].to(device)
        path = self.directory / f"{key}.safetensors"
        if self.use_disk and clip.identity and path.is_file():
            try:
                feats = load_file(str(path))["features"]
                self.memory[key] = feats
                return feats.to(device)
            except Exception:  # a corrupt cache entry is recomputed, never trusted
                path.unlink(missing_ok=True)
        feats = self._run_encoder(clip, sentences, batch_size, device)
        self.memory[key] = feats.cpu()
        if self.use_disk and clip.identity:
            save_safetensors({"features": feats}, path, {"model": clip.identity})
        return feats

    @torch.no_grad()
    def _run_encoder(self, clip: LoadedClip, sentences: list[str], batch_size: int,
                     device: torch.device) -> torch.Tensor:
        self.encoder_calls += 1
        chunks = []
        for start in range(0, len(sentences), batch_size):
            tokens = clip.tokenizer(sentences[start:start + batch_size]).to(device)
            chunks.append(clip.model.encode_text(tokens).float())
        return torch.nn.functional.normalize(torch.cat(chunks), dim=-1)

    def class_features(self, clip: LoadedClip, sentences: ClassSentences) -> torch.Tensor:
        """[C, K, E] features for a sentence grid (row c = label c)."""
        flat = self.encode(clip, sentences.flat())
        return flat.view(len(sentences.class_names), sentences.k, -1)
