"""`fedmvp info`: parameter counts and upload sizes of FedMVP on a given CLIP, so a deployment can
be sized before training."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import click

from fedmvp_apps.cli.common import BadInput, emit_json, quiet_open_clip_logging


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


def model_sizes(model: Any, classes: int, k: int = 10) -> ModelSizes:
    """Sizes of a built ``FedMVP`` (random weights suffice: counts do not depend on them)."""
    from safetensors.torch import save as safetensors_bytes

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



def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1000
    return str(n)


@click.command()
@click.option("--model", "model_name", default="ViT-B-16", show_default=True,
              help="open_clip model name (e.g. ViT-B-16, fedmvp-tiny).")
@click.option("--pretrained", default=None,
              help="Pretrained tag or weights file. Counts do not depend on weights, so none are loaded.")
@click.option("--classes", default=20, show_default=True, type=click.IntRange(min=1),
              help="Candidate classes per client (the paper's clients have 20).")
@click.option("--prompts", default=4, show_default=True, type=click.IntRange(min=1), help="Prompt tokens m.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def info(model_name: str, pretrained: str | None, classes: int, prompts: int, as_json: bool) -> None:
    """Size a deployment before training: parameters of CLIP, the PromptFormer and its LoRA,
    and the bytes one client uploads per round before and after the LoRA switch.

    The architecture is built with random weights; nothing is downloaded."""
    quiet_open_clip_logging()
    from fedmvp.clip import ClipLoadError, load_clip
    from fedmvp.model import FedMVP, FedMVPConfig

    try:
        clip = load_clip(model_name, None)
    except ClipLoadError as err:
        raise BadInput(str(err)) from err
    sizes = model_sizes(FedMVP(clip, FedMVPConfig(num_prompts=prompts)), classes)
    data = sizes.as_dict() | {"pretrained": pretrained}
    if as_json:
        emit_json(data)
        return
    rows = [
        ("CLIP (frozen)", f"{sizes.clip_params:,}"),
        ("  visual encoder", f"{sizes.visual_params:,}"),
        ("  text encoder", f"{sizes.text_params:,}"),
        ("PromptFormer (trained before the switch)", f"{sizes.promptformer_params:,}"),
        ("LoRA (trained after the switch)", f"{sizes.lora_params:,}"),
        ("PromptFormer / LoRA", f"{sizes.promptformer_to_lora:.2f}x"),
        ("LoRA / PromptFormer", f"{100 * sizes.lora_fraction_of_promptformer:.2f}%"),
        ("PromptFormer / CLIP", f"{100 * sizes.promptformer_fraction_of_clip:.2f}%"),
        ("upload per round, full", _human(sizes.upload_bytes_full)),
        ("upload per round, LoRA only", _human(sizes.upload_bytes_lora)),
        (f"cached text features ({classes} classes x 10)", _human(sizes.text_feature_bytes)),
    ]
    width = max(len(r[0]) for r in rows)
    click.echo(f"{model_name}" + (f" ({pretrained})" if pretrained else ""))
    for label, value in rows:
        click.echo(f"  {label:<{width}}  {value:>14}")
