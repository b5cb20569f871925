"""The edge model as one ``nn.Module``: frozen prompted CLIP with the attribute text side baked in.

Everything that depends only on the class set is computed once at export and stored as
constants: the classifier matrix (mean of each class's attribute features), the
PromptFormer's key context (LayerNorm'd projection) and value context (raw projection) of
every attribute sentence, and their base K/V projections. Per image only the query path
runs. LoRA stays separate: K = K_base + (ctx_key @ A_k^T) @ B_k^T * s (same for V, Q), so
the LoRA tensors are standalone named tensors (stable names ``lora.*``) that the edge can
swap without re-exporting, and that the training artifact can differentiate.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from export.errors import ExportError
from fedmvp.model import LORA_PREFIX, PROMPTFORMER_PREFIX, FedMVP
from fedmvp.prompted_vit import encode_tokens, patch_embeds, prompted

SPLIT_TARGETS = ("to_q", "to_k", "to_v")  # the projections whose LoRA the edge graph adds as a separate delta
CONTEXT_OF = {"to_k": "text.key_context", "to_v": "text.value_context"}  # read only by that LoRA's delta


@contextlib.contextmanager
def no_mha_fastpath() -> Iterator[None]:
    """nn.MultiheadAttention's fused fast path (taken when nothing needs grad) does not export."""
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


def lora_targets(model: FedMVP) -> tuple[str, ...]:
    """The projections that carry LoRA, from the method record the model was rebuilt from (``lora_targets``).

    Why from the record: a run trained with LoRA on q and v only has no k tensors to export, and a
    neutral LoRA for a no-LoRA run must have the shapes the record names. In SPLIT_TARGETS order, so a
    record's order does not change the graph's input order."""
    recorded = tuple(model.config.lora_targets)
    unknown = sorted(set(recorded) - set(SPLIT_TARGETS))
    if unknown or not recorded:
        raise ExportError(f"method record: lora_targets {list(recorded)} cannot be exported; the edge graph "
                          f"carries LoRA on {', '.join(SPLIT_TARGETS)} (one or more)")
    return tuple(t for t in SPLIT_TARGETS if t in recorded)


def lora_name(target: str, part: str) -> str:
    """Stable name of a LoRA tensor, identical to ``FedMVP.state('lora')``."""
    return f"{LORA_PREFIX}block.attn.{target}.lora_{part}.weight"


def _register(root: nn.Module, dotted: str, tensor: torch.Tensor, parameter: bool) -> None:
    """Register ``tensor`` at a dotted path so its FQN (and ONNX initializer name) is ``dotted``."""
    *path, leaf = dotted.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if parameter:
        module.register_parameter(leaf, nn.Parameter(tensor))
    else:
        module.register_buffer(leaf, tensor)


class PromptHead(nn.Module):
    """The query side of the PromptFormer block: LN(query), q projection, attention, out, FF, pooling."""

    def __init__(self, model: FedMVP):
        super().__init__()
        block = model.promptformer.block
        self.heads = block.attn.heads
        self.norm_query = block.norm_query
        to_q = block.attn.to_q
        self.to_q = getattr(to_q, "base_layer", to_q)
        self.to_out = block.attn.to_out
        self.ff = block.ff
        self.register_buffer("pool", model.promptformer.pool.detach().clone().float())


class EdgeClassifier(nn.Module):
    """pixel_values [N,3,H,W] -> (logits [N,C], probs [N,C], image_embeds [N,E] normalised)."""

    def __init__(self, model: FedMVP, text_features: torch.Tensor, lora: dict[str, torch.Tensor]):
        super().__init__()
        self.visual = prompted(model.clip.visual)  # typed before tracing: the export sees plain methods
        self.prompt = PromptHead(model)
        self.lora_targets = lora_targets(model)
        self.lora_names = [lora_name(t, p) for t in self.lora_targets for p in ("A", "B")]
        self.lora_scaling = lora_scaling(model)
        attn = model.promptformer.block.attn
        with torch.no_grad():
            feats = text_features.detach().float().to(self.prompt.pool.device)
            raw = model.promptformer.context(feats)[0]  # [C*K, D]: the value context
            key = model.promptformer.block.norm_context(raw)  # [C*K, D]: the key context
            base = {t: getattr(getattr(attn, t), "base_layer", getattr(attn, t)) for t in SPLIT_TARGETS}
            text = {
                "text.key_context": key, "text.value_context": raw,
                "text.key_base": base["to_k"](key), "text.value_base": base["to_v"](raw),
                "text.class_weights": feats.mean(dim=1),
                "text.logit_scale": model.logit_scale.detach().float().reshape(()),
            }
        for name, value in text.items():
            _register(self, name, value.detach().clone().contiguous(), parameter=False)
        for name in self.lora_names:
            _register(self, name, lora[name].detach().clone().float().contiguous(), parameter=True)

    # ---- tensors ----------------------------------------------------------------------------
    def lora_tensors(self) -> dict[str, torch.Tensor]:
        tensors = dict(self.named_parameters())
        return {name: tensors[name] for name in self.lora_names}

    def frozen_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor except LoRA, by FQN (the names the bundle's weights file uses)."""
        named = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        return {k: v for k, v in named.items() if k not in self.lora_names}

    def unread_constants(self) -> set[str]:
        """Baked text contexts the graph never reads: a context feeds only its projection's LoRA delta, so
        without LoRA there the ONNX export drops it (a refresh still rewrites it in weights.safetensors)."""
        return {context for target, context in CONTEXT_OF.items() if target not in self.lora_targets}

    def tensor(self, dotted: str) -> torch.Tensor:
        """A tensor by FQN via attribute lookup (works when functional_call swapped it for a plain tensor)."""
        obj = self
        for part in dotted.split("."):
            obj = getattr(obj, part)
        return obj

    def _plus_lora(self, base: torch.Tensor, x: torch.Tensor, target: str) -> torch.Tensor:
        """``base`` plus ``x``'s LoRA delta on ``target``; ``base`` alone where the record puts no LoRA on
        ``target`` (decided at export, so the graph holds no zero delta)."""
        if target not in self.lora_targets:
            return base
        a = self.tensor(lora_name(target, "A"))
        b = self.tensor(lora_name(target, "B"))
        delta = (x @ a.t()) @ b.t()
        return base + (delta * self.lora_scaling if self.lora_scaling != 1.0 else delta)

    # ---- forward ------------------------------------------------------------------------------
    def prompts(self, patches: torch.Tensor) -> torch.Tensor:
        """[B, P, D] patch embeddings -> [B, m, D] prompt tokens (same math as PromptFormer)."""
        head = self.prompt
        b, p, d = patches.shape
        hd = d // head.heads
        nq = head.norm_query(patches)
        q = self._plus_lora(head.to_q(nq), nq, "to_q")
        k = self._plus_lora(self.tensor("text.key_base"), self.tensor("text.key_context"), "to_k")
        v = self._plus_lora(self.tensor("text.value_base"), self.tensor("text.value_context"), "to_v")
        q = q.view(b, p, head.heads, hd).transpose(1, 2)  # [B, h, P, hd]
        k = k.view(-1, head.heads, hd).transpose(0, 1)  # [h, N, hd]
        v = v.view(-1, head.heads, hd).transpose(0, 1)
        attn = torch.softmax((q @ k.transpose(-1, -2)) * (hd ** -0.5), dim=-1)
        out = head.to_out((attn @ v).transpose(1, 2).reshape(b, p, d))
        out = out + head.ff(out)
        return torch.einsum("mp,bpd->bmd", head.pool, out)

    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Normalised prompted image feature."""
        tokens = patch_embeds(self.visual, pixel_values)
        return F.normalize(encode_tokens(self.visual, tokens, self.prompts(tokens[:, 1:])), dim=-1)

    def encode_frozen(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Normalised unprompted CLIP feature (the consistency target)."""
        return F.normalize(self.visual(pixel_values), dim=-1)

    def logits(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.tensor("text.logit_scale") * embeds @ self.tensor("text.class_weights").t()

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        embeds = self.encode(pixel_values)
        logits = self.logits(embeds)
        return logits, torch.softmax(logits, dim=-1), embeds


def query_copy_map(model: FedMVP, edge: EdgeClassifier) -> dict[str, str]:
    """Run name -> bundle weights name of each PromptFormer tensor the edge module holds as it is.

    These are the query side (``prompt.*``); a bundle refresh copies them (docs/method.md §10).
    Matched by identity, since `PromptHead` holds the model's own modules: nothing is guessed from names."""
    held = {id(param): name for name, param in edge.named_parameters()}
    return {stable: held[id(param)] for stable, param in model.named_tensors().items()
            if stable.startswith(PROMPTFORMER_PREFIX) and id(param) in held}


def lora_scaling(model: FedMVP) -> float:
    """peft's alpha / r (1.0 with the project's config), read from a layer that carries LoRA."""
    layer = getattr(model.promptformer.block.attn, lora_targets(model)[0])
    scaling = getattr(layer, "scaling", None)
    return float(scaling.get("default", 1.0)) if isinstance(scaling, dict) else 1.0


def model_lora(model: FedMVP, seed: int = 0) -> dict[str, torch.Tensor]:
    """The model's LoRA tensors; a model built without LoRA gets a neutral one (B = 0) to train on device."""
    state = model.state("lora")
    if state:
        return state
    rank, width = model.config.lora_rank, model.clip_info.vision_width
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for target in lora_targets(model):
        a = torch.empty(rank, width)
        bound = 1.0 / math.sqrt(width)  # kaiming_uniform(a=sqrt(5)) bound, as peft initialises A
        out[lora_name(target, "A")] = a.uniform_(-bound, bound, generator=generator)
        out[lora_name(target, "B")] = torch.zeros(width, rank)
    return out


def build_edge_classifier(model: FedMVP, text_features: torch.Tensor,
                          lora: dict[str, torch.Tensor] | None = None) -> EdgeClassifier:
    """An ``EdgeClassifier`` for ``model`` (checkpoint loaded) over ``text_features`` [C, K, E]."""
    model.eval()
    edge = EdgeClassifier(model, text_features, lora if lora is not None else model_lora(model))
    return edge.eval()
