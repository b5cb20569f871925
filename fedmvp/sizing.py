"""Parameter counts and per-round upload sizes, so a deployment can be sized before training."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from safetensors.torch import save as safetensors_bytes

from fedmvp.model import FedMVP


def count(params) -> int:
    return int(sum(p.numel() for p in params))


@dataclass
class ModelSizes:
    model: str
    clip_params: int
    visual_params: int
    text_params: int
    promptformer_params: int
    lora_params: int
    promptformer_to_lora: float  # the paper's "267x fewer trainable parameters"
    lora_fraction_of_promptformer: float
    promptformer_fraction_of_clip: float
    upload_bytes_full: int  # one client's reply before the switch (safetensors, fp32)
    upload_bytes_lora: int  # after the switch
    classes: int
    attribute_sentences: int
    text_feature_bytes: int  # cached [C, K, E] fp32 features kept by every client

    def as_dict(self) -> dict:
        return asdict(self)


def model_sizes(model: FedMVP, classes: int, k: int = 10) -> ModelSizes:
    clip = model.clip
    pf = model.state("promptformer")
    lora = model.state("lora") if model.config.use_lora else {}
    pf_params = count(pf.values())
    lora_params = count(lora.values())
    embed = int(clip.visual.output_dim)
    return ModelSizes(
        model=model.clip_info.name,
        clip_params=count(clip.parameters()),
        visual_params=count(clip.visual.parameters()),
        text_params=count(clip.parameters()) - count(clip.visual.parameters()),
        promptformer_params=pf_params,
        lora_params=lora_params,
        promptformer_to_lora=round(pf_params / lora_params, 2) if lora_params else 0.0,
        lora_fraction_of_promptformer=round(lora_params / pf_params, 6) if pf_params else 0.0,
        promptformer_fraction_of_clip=round(pf_params / count(clip.parameters()), 6),
        upload_bytes_full=len(safetensors_bytes(pf)),
        upload_bytes_lora=len(safetensors_bytes(lora)) if lora else 0,
        classes=classes,
        attribute_sentences=classes * k,
        text_feature_bytes=classes * k * embed * 4,
    )
