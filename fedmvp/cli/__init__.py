"""`fedmvp` command line: one module per subcommand, registered here by name."""

from __future__ import annotations

import click

from fedmvp import __version__
from fedmvp.cli.lazy import LazyGroup

SUBCOMMANDS = {
    "info": "fedmvp.cli.info:info",
    "demo": "fedmvp.cli.demo:demo",
    "world": "fedmvp.cli.world:world",
    "pretrain-tiny": "fedmvp.cli.pretrain_tiny:pretrain_tiny",
    "train": "fedmvp.cli.train:train",
    "evaluate": "fedmvp.cli.evaluate:evaluate",
    "ingest": "fedmvp.cli.ingest:ingest",
    "attributes": "fedmvp.cli.attributes:attributes",
    "certs": "fedmvp.cli.certs:certs",
    "serve": "fedmvp.cli.serve:serve",
    "join": "fedmvp.cli.join:join",
}


@click.group(cls=LazyGroup, lazy_subcommands=SUBCOMMANDS,
             context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fedmvp")
def main() -> None:
    """FedMVP: federated multimodal visual prompt tuning for CLIP.

    Train a PromptFormer (and later only its LoRA) across sites that cannot share
    data, evaluate it the way the paper does, and hand the result to
    `fedmvp-export` for edge devices. Everything runs offline by default.
    """
