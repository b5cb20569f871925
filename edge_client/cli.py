"""`edge-client` command line."""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Run a fedmvp bundle on this device and improve it with local data.

    `infer` classifies images with ONNX Runtime (no torch needed); `train` updates
    only the LoRA tensors on local labelled images and writes an update file that
    the federation's server can aggregate.
    """
