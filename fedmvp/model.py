"""FedMVP: frozen CLIP + PromptFormer (+ peft LoRA), the attribute classifier and the loss.

docs/method.md §2-5. The only trainable tensors are the PromptFormer's (before the LoRA
switch) or its LoRA's (after). They travel under stable names, ``promptformer.*`` and
``lora.*``, identical in checkpoints, Flower messages, bundles and update files.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from fedmvp_formats.method import MethodRecord
from fedmvp_formats.names import LORA_PREFIX, PROMPTFORMER_PREFIX
from fedmvp_formats.objective import consistency_on, fedmvp_objective

from fedmvp.clip import LoadedClip, load_clip
from fedmvp.prompted_vit import encode_tokens, patch_embeds
from fedmvp.promptformer import PromptFormer, PromptFormerConfig


class FedMVPConfig(MethodRecord):
    """The method record as the training core builds the model from it (fields, ranges, version and
    migration: ``fedmvp_formats.method``, the one definition; docs/method.md)."""


def autocast_for(device: torch.device | str) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (fp32 master weights stay fp32); nothing on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def flip_views(images: torch.Tensor, flip_prob: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """A horizontally flipped view for each sample with probability ``flip_prob`` (not one coin per batch)."""
    coins = torch.rand(images.shape[0], generator=generator, device="cpu") < flip_prob
    coins = coins.to(images.device).view(-1, 1, 1, 1)
    return torch.where(coins, images.flip(-1), images)


class FedMVP(nn.Module):
    """Prompted CLIP classifier over attribute sentences."""

    def __init__(self, clip: LoadedClip, config: FedMVPConfig | None = None):
        super().__init__()
        self.config = config or FedMVPConfig()
        self.clip = clip.model
        self.clip_info = clip
        pf_config = PromptFormerConfig(text_dim=clip.embed_dim, width=clip.vision_width,
                                       heads=self.config.heads, ff_mult=self.config.ff_mult,
                                       num_patches=clip.num_patches, num_prompts=self.config.num_prompts)
        self.promptformer = PromptFormer(pf_config)
        if self.config.use_lora:
            lora = LoraConfig(r=self.config.lora_rank, lora_alpha=self.config.lora_rank, lora_dropout=0.0,
                              target_modules=list(self.config.lora_targets), bias="none")
            inject_adapter_in_model(lora, self.promptformer)
        self.register_buffer("text_features", torch.zeros(0, 1, clip.embed_dim), persistent=False)
        self.lora_active = False
        self._set_trainable(promptformer=True, lora=False)

    # ---- the one rebuild (docs/architecture.md, "Records that travel") ------------------------------
    @classmethod
    def build(cls, clip: str, pretrained: str | None, method: FedMVPConfig, seed: int,
              device: str | torch.device = "cpu") -> "FedMVP":
        """The initial global model of a run: a function of the seed, the CLIP and the method record alone,
        so every process (clients, server, exporter) builds the same one. The seed is set before the CLIP
        (a random-init backbone) and again before the PromptFormer (its initial state)."""
        torch_device = torch.device(device)
        torch.manual_seed(seed)
        loaded = load_clip(clip, pretrained or None, device=torch_device)
        torch.manual_seed(seed)
        return cls(loaded, method).to(torch_device)

    @classmethod
    def from_run(cls, run: "RunDir", round_number: "int | Checkpoint | None" = None,
                 device: str | torch.device = "cpu") -> "FedMVP":
        """THE rebuild of a run's model: its seed, its CLIP (config.json ``model``), the method record the
        round was trained as (its state.json first, then config.json) and the round's weights, in eval mode.

        ``round_number``: a complete round, a loaded ``Checkpoint`` of the run, None (the last round) or 0
        (the initial model, before any round). Errors are ``RunError`` (or ``ClipLoadError``), one line
        naming the file. ``run`` is a ``fedmvp.runs.RunDir`` (not imported: the run reads its method
        record with this module's ``FedMVPConfig``)."""
        if round_number == 0:
            checkpoint = None
        elif round_number is None or isinstance(round_number, int):
            checkpoint = run.load_checkpoint(round_number)
        else:
            checkpoint = round_number
        clip, pretrained = run.clip_spec()
        model = cls.build(clip, pretrained, run.method(checkpoint), run.seed, device)
        if checkpoint is not None:
            run.load_weights(model, checkpoint)
        return model.eval()

    # ---- trainable tensors and their stable names -------------------------------------------
    def _named_promptformer_tensors(self) -> dict[str, nn.Parameter]:
        out = {}
        for name, param in self.promptformer.named_parameters():
            if "lora_" in name:
                key = LORA_PREFIX + name.replace(".default", "")
            else:
                key = PROMPTFORMER_PREFIX + name.replace(".base_layer", "")
            out[key] = param
        return out

    def named_tensors(self) -> dict[str, nn.Parameter]:
        """The live PromptFormer and LoRA parameters by stable name (not copies: the exporter finds
        which of them its edge module holds by identity)."""
        return self._named_promptformer_tensors()

    def _set_trainable(self, promptformer: bool, lora: bool) -> None:
        for key, param in self._named_promptformer_tensors().items():
            param.requires_grad_(lora if key.startswith(LORA_PREFIX) else promptformer)

    def set_lora_mode(self, active: bool) -> None:
        """Train LoRA only (after the switch) or the PromptFormer only (before it)."""
        if active:
            self.use_lora()
        else:
            self.lora_active = False
            self._set_trainable(promptformer=True, lora=False)

    def use_lora(self) -> None:
        """The switch (docs/method.md §4): freeze the PromptFormer, train only LoRA from now on."""
        if not self.config.use_lora:
            raise RuntimeError("this model was built without LoRA (use_lora=False)")
        self.lora_active = True
        self._set_trainable(promptformer=False, lora=True)

    def state(self, kind: str = "trainable") -> dict[str, torch.Tensor]:
        """Tensors by stable name: 'trainable' (what a client sends now), 'promptformer', 'lora' or 'all'."""
        if kind == "trainable":
            kind = "lora" if self.lora_active else "promptformer"
        tensors = self._named_promptformer_tensors()
        prefixes = {"promptformer": (PROMPTFORMER_PREFIX,), "lora": (LORA_PREFIX,),
                    "all": (PROMPTFORMER_PREFIX, LORA_PREFIX)}[kind]
        return {k: v.detach().clone() for k, v in tensors.items() if k.startswith(prefixes)}

    def load_state(self, tensors: dict[str, torch.Tensor], strict: bool = False) -> list[str]:
        """Copy tensors in by stable name; returns names of model tensors not provided."""
        own = self._named_promptformer_tensors()
        unknown = sorted(set(tensors) - set(own))
        if unknown:
            raise KeyError(f"unknown tensors: {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
        for name, value in tensors.items():
            if own[name].shape != value.shape:
                raise ValueError(f"{name}: shape {tuple(value.shape)} != {tuple(own[name].shape)}")
            with torch.no_grad():
                own[name].copy_(value.to(own[name].device, own[name].dtype))
        missing = sorted(set(own) - set(tensors))
        if strict and missing:
            raise KeyError(f"missing tensors: {', '.join(missing[:5])}")
        return missing

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.promptformer.parameters() if p.requires_grad]

    # ---- classifier ---------------------------------------------------------------------------
    def set_text_features(self, features: torch.Tensor) -> None:
        """[C, K, E] normalised attribute features of the candidate classes (label order)."""
        if features.dim() != 3:
            raise ValueError(f"text features must be [C, K, E], got {tuple(features.shape)}")
        device = self.clip.logit_scale.device
        self.text_features = features.detach().to(device, torch.float32)

    @property
    def class_weights(self) -> torch.Tensor:
        """[C, E] = mean_k t_ck: logit_c = s * f . mean_k t_ck = s * mean_k cos(f, t_ck)."""
        return self.text_features.mean(dim=1)

    @property
    def logit_scale(self) -> torch.Tensor:
        return self.clip.logit_scale.exp()

    def logits(self, image_features: torch.Tensor) -> torch.Tensor:
        return self.logit_scale * image_features @ self.class_weights.t().to(image_features.dtype)

    # ---- image features -------------------------------------------------------------------------
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Normalised prompted image feature f_prompted(x)."""
        if self.text_features.shape[0] == 0:
            raise RuntimeError("call set_text_features() before encoding images")
        visual = self.clip.visual
        tokens = patch_embeds(visual, images)
        prompts = self.promptformer(tokens[:, 1:], self.text_features.to(tokens.dtype))
        return F.normalize(encode_tokens(visual, tokens, prompts), dim=-1)

    @torch.no_grad()
    def encode_frozen(self, images: torch.Tensor) -> torch.Tensor:
        """Normalised unprompted CLIP feature (the consistency target)."""
        return F.normalize(self.clip.encode_image(images), dim=-1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.logits(self.encode(images))

    def loss(self, images: torch.Tensor, labels: torch.Tensor, frozen_targets: torch.Tensor | None = None,
             generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """L = CE + alpha * (1 - cos(f_prompted(x), f_CLIP(x'))), x' a per-sample flipped view: the one
        objective of ``fedmvp_formats.objective`` (the device trains the same). The frozen targets (a
        forward pass and the flip's draws from ``generator``) are computed only when alpha counts."""
        features = self.encode(images)
        if consistency_on(self.config.alpha) and frozen_targets is None:
            frozen_targets = self.encode_frozen(flip_views(images, self.config.flip_prob, generator))
        return fedmvp_objective(features, self.logits(features), frozen_targets, labels, self.config.alpha, F)

    def train(self, mode: bool = True) -> "FedMVP":
        """CLIP stays in eval mode whatever the PromptFormer does."""
        super().train(mode)
        self.clip.eval()
        return self
