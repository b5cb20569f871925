"""`fedmvp-export` command line."""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, invoke_without_command=True)
@click.pass_context
def main(ctx: click.Context) -> None:
    """Compile a round of a fedmvp run into an edge bundle.

    The bundle holds one ONNX model (frozen CLIP + PromptFormer + cached attribute
    text features), a training artifact for LoRA-only updates on the device, the
    LoRA tensors and a manifest with hashes and a PyTorch parity check.
    """
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())
