"""`fedmvp pretrain-tiny`: pretrain the tiny CLIP on the synthetic world (the shipped weights)."""

from __future__ import annotations

from pathlib import Path

import click

from fedmvp_apps.cli.common import FiniteFloat, emit_json, quiet_open_clip_logging


@click.command("pretrain-tiny")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("fedmvp-tiny-synthetic.safetensors"), show_default=True,
              help="Weights file to write (fp16 safetensors, written atomically). The shipped file is "
                   "fedmvp/weights/fedmvp-tiny-synthetic.safetensors.")
@click.option("--steps", default=1300, show_default=True, type=click.IntRange(min=1), help="Optimiser steps.")
@click.option("--batch-size", default=128, show_default=True, type=click.IntRange(min=2),
              help="Images (and captions) per contrastive batch.")
@click.option("--lr", default=1e-3, show_default=True, type=FiniteFloat(min=0, min_open=True), help="Peak AdamW learning rate (cosine decay).")
@click.option("--warmup", default=100, show_default=True, type=click.IntRange(min=0), help="Linear warm-up steps.")
@click.option("--seed", default=0, show_default=True, type=int, help="Initialisation and data-stream seed.")
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1), help="Torch CPU threads.")
@click.option("--workers", default=1, show_default=True, type=click.IntRange(min=0),
              help="Processes rendering batches ahead of training (0: render inline). Results do not depend on it.")
@click.option("--save-every", default=0, show_default=True, type=click.IntRange(min=0),
              help="Also write a snapshot <out>.step<N>.safetensors every N steps (0: never).")
@click.option("--write-vocab", is_flag=True,
              help="First regenerate the compact tokenizer's vocabulary file from every text of the world "
                   "(fedmvp/model_configs/fedmvp-tiny-vocab.json). Weights and vocabulary must match.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary.")
def pretrain_tiny(out: Path, steps: int, batch_size: int, lr: float, warmup: int, seed: int, threads: int,
                  workers: int, save_every: int, write_vocab: bool, as_json: bool) -> None:
    """Pretrain fedmvp-tiny (32 px ViT, 4+4 layers of width 128, ~1.8M parameters) from
    scratch with a contrastive loss on an endless, seeded stream of rendered images of the
    48 SEEN classes, captioned by made-up names, attribute descriptions and attribute
    sentences. The 16 held-out compositions are never captioned by name.

    The defaults reproduce the shipped weights (about 15-25 minutes on 2 CPU cores):

        fedmvp pretrain-tiny --write-vocab --out fedmvp/weights/fedmvp-tiny-synthetic.safetensors
    """
    quiet_open_clip_logging()
    from fedmvp.clip import REGISTRY, PACKAGE_DIR
    from fedmvp.synthetic.pretrain import PretrainConfig, pretrain, write_vocab as regenerate_vocab

    vocab_path = PACKAGE_DIR / REGISTRY["tokenizers"]["fedmvp-tiny"]["vocab"]
    kept = None
    if write_vocab:
        kept = regenerate_vocab(vocab_path)
        if not as_json:
            click.echo(f"vocabulary: {kept} BPE tokens kept -> {vocab_path}")
    warmup = min(warmup, max(0, steps - 1))
    config = PretrainConfig(steps=steps, batch_size=batch_size, lr=lr, warmup=warmup, seed=seed,
                            threads=threads, workers=workers, save_every=save_every)
    summary = pretrain(config, out, progress=True)
    summary |= {"vocab": str(vocab_path), "vocab_tokens": kept}
    if as_json:
        emit_json(summary)
        return
    click.echo(f"wrote {summary['out']} ({summary['bytes'] / 1e6:.2f} MB, {summary['params']:,} parameters, "
               f"{summary['steps']} steps, final loss {summary['final_loss']:.3f})")
    click.echo(f"measure it: python benchmarks/zero_shot_tiny.py --pretrained {summary['out']}")
