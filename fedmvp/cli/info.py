"""`fedmvp info`: parameter counts and upload sizes of FedMVP on a given CLIP."""

from __future__ import annotations

import click

from fedmvp.cli.common import BadInput, emit_json, quiet_open_clip_logging


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
    from fedmvp.sizing import model_sizes

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
