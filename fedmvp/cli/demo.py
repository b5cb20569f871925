"""`fedmvp demo`: the README's main command (grows with the federated, export and edge issues)."""

from __future__ import annotations

import click

from fedmvp.cli.common import quiet_open_clip_logging


@click.command()
@click.option("--steps", default=30, show_default=True, type=click.IntRange(min=1),
              help="Local SGD steps to show the loss falling.")
def demo(steps: int) -> None:
    """Show the FedMVP model core on the tiny CLIP: sizes, then a few training steps."""
    quiet_open_clip_logging()
    import math

    import torch
    from tqdm import tqdm

    from fedmvp.clip import load_clip
    from fedmvp.model import FedMVP
    from fedmvp.sizing import model_sizes

    torch.manual_seed(0)
    clip = load_clip("fedmvp-tiny", None)
    clip.model.logit_scale.data.fill_(math.log(100.0))
    model = FedMVP(clip)
    model.set_text_features(torch.nn.functional.normalize(torch.randn(6, 10, clip.embed_dim), dim=-1))
    sizes = model_sizes(model, classes=6)
    click.echo(f"fedmvp-tiny (random init): CLIP {sizes.clip_params:,} params, PromptFormer "
               f"{sizes.promptformer_params:,}, LoRA {sizes.lora_params:,}")
    images, labels = torch.randn(32, 3, 32, 32), torch.arange(32) % 6
    opt = torch.optim.SGD(model.trainable_parameters(), lr=0.003, momentum=0.9, weight_decay=1e-5)
    targets = model.encode_frozen(images)
    first = last = 0.0
    for step in tqdm(range(steps), desc="local steps"):
        opt.zero_grad()
        out = model.loss(images, labels, frozen_targets=targets)
        out["loss"].backward()
        opt.step()
        first = out["loss"].item() if step == 0 else first
        last = out["loss"].item()
    click.echo(f"loss {first:.3f} -> {last:.3f}")
