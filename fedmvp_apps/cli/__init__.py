"""`fedmvp` command line: one module per subcommand, registered here by name."""

from __future__ import annotations

import click

from fedmvp import __version__
from fedmvp_apps.cli.lazy import LazyGroup

SUBCOMMANDS = {
    "info": "fedmvp_apps.cli.info:info",
    "demo": "fedmvp_apps.cli.demo:demo",
    "world": "fedmvp_apps.cli.world:world",
    "pretrain-tiny": "fedmvp_apps.cli.pretrain_tiny:pretrain_tiny",
    "train": "fedmvp_apps.cli.train:train",
    "evaluate": "fedmvp_apps.cli.evaluate:evaluate",
    "ingest": "fedmvp_apps.cli.ingest:ingest",
    "region-start": "fedmvp_apps.cli.regions:region_start",
    "region-update": "fedmvp_apps.cli.regions:region_update",
    "attributes": "fedmvp_apps.cli.attributes:attributes",
    "certs": "fedmvp_apps.cli.certs:certs",
    "serve": "fedmvp_apps.cli.serve:serve",
    "join": "fedmvp_apps.cli.join:join",
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
