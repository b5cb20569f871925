"""`edge-client join`: this device as a node of the federation, a Flower SuperNode of role ``edge``.

Everything is checked before the SuperNode starts (bundle verified and trainable, the local
folder holds images of the bundle's classes, the held-out share is not empty, certificates
exist); then ``flower-supernode`` starts through the one SuperNode launch that `fedmvp join` uses
too (``fedmvp_apps.deploy.supernode``), with one warm process that runs every round's message, so
the training program is loaded once, not every round. The node config tells the federation's ClientApp (``node_app.client_app``) that
this node is an edge device and where its bundle and images are; each round it is asked, the
device trains the global LoRA on its images (``edge_client.node``). Needs ``flwr`` and torch:
``pip install fedmvp[cpu,edge-join]`` (no open_clip, no peft, no training core).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from edge_client.engines import DEFAULT_RUNTIME, PRECISIONS, factory, runtime_names
from edge_client.train_options import DEVICES, OPTIMIZERS, TrainInputError, TrainOptions
from fedmvp_apps.deploy.supernode import LaunchError, become_supernode, supernode_command
from fedmvp_apps.edge_bundle import BUNDLE_DEFAULT, BundleDir, bundle_option_callback

# What an edge device installs to join (pyproject's edge-join extra: flwr and torch, no training core).
EDGE_JOIN_INSTALL = "fedmvp[edge-join]"


def check_node(node, break_lock: bool = False) -> dict:
    """Open what the node will use each round, so a bad path fails now, not in round 1 (a bundle lock whose
    record names another host too, unless ``break_lock`` takes it over)."""
    from edge_client.bundle import Bundle
    from edge_client.refresh import recover_refresh

    recover_refresh(node.bundle, break_lock)
    bundle = Bundle.open(node.bundle, verify=True)
    bundle.require_trainable()
    if node.device == "cuda":
        try:
            import torch
        except ImportError as err:
            raise TrainInputError(f"training needs torch ({err}); install {EDGE_JOIN_INSTALL}") from None
        if not torch.cuda.is_available():
            raise TrainInputError("--device cuda: CUDA is not available to torch on this device")
    check_runtime(node, bundle)
    training, held_out = node.shares(bundle)
    if not held_out.files:
        raise TrainInputError(f"{node.data}: no image can be held out for evaluation (a class needs 2 images, "
                              f"or give --eval-data)")
    return {"bundle": str(bundle.path), "round": bundle.round, "train_images": len(training),
            "eval_images": len(held_out), "classes": len(training.classes)}


def check_runtime(node, bundle) -> None:
    """The runtime and precision the rounds will evaluate on are offered here: one named and missing is
    an error now (exit 2), never a silent fallback in round 1 (edge_client/engines.py). ``auto`` is chosen,
    and verified, by the node at its first evaluation (``edge_client.node._warm_predictor``)."""
    from edge_client.engines import candidates

    candidates(bundle, node.runtime, node.precision)


class RegisteredRuntimes(click.Choice):
    """--runtime's choices: auto and the runtimes registered when the command line is read
    (edge_client/engines.py, register_runtime), not those of when the option was declared."""

    def __init__(self) -> None:
        super().__init__([], case_sensitive=False)

    @property
    def choices(self) -> tuple[str, ...]:
        return ("auto", *runtime_names())

    @choices.setter
    def choices(self, value: Any) -> None:
        pass  # click.Choice.__init__ sets it; the table is the one source


def runtime_options(f: Any) -> Any:
    """--runtime and --precision (edge_client/runtime_choice.py): one definition for `join`, `infer` and
    `info` (edge_cli.py imports it from here), so all three offer the same choices with the same help."""
    f = click.option("--precision", type=click.Choice(["auto", *PRECISIONS], case_sensitive=False),
                     default="auto", show_default=True,
                     help="What the model computes in, where the runtime and this machine offer it (int8: the "
                          "bundle's int8 model). auto: the fastest verified against the bundle as exported.")(f)
    named = ", ".join(f"{name} ({factory(name).label})" for name in runtime_names())
    return click.option("--runtime", type=RegisteredRuntimes(), default=DEFAULT_RUNTIME,
                        show_default=True,
                        help=f"{named} or auto: the fastest runtime and "
                             "precision that pass verification on the bundle's check images (cached per bundle "
                             "and machine). A runtime named and missing is an error.")(f)


def _option(*decls: str, name: str, **kwargs):
    """A click option whose default and help are `TrainOptions` field ``name``'s."""
    kwargs.setdefault("help", TrainOptions.help(name))
    return click.option(*decls, default=TrainOptions.default(name), show_default=True, **kwargs)


@click.command()
@click.option("--superlink", required=True, metavar="HOST:PORT", help="The federation server's address (`fedmvp serve`).")
@click.option("--bundle", type=click.Path(path_type=Path, file_okay=False), default=None,
              callback=bundle_option_callback,
              help=f"Bundle directory ({BUNDLE_DEFAULT}); refreshed in place when the "
                   "server's PromptFormer has moved on (the previous one kept: `edge-client rollback --refresh`).")
@click.option("--data", type=click.Path(path_type=Path, file_okay=False), required=True,
              help="Local labelled images, DATA/<class>/<image> (classes must be the bundle's); they never "
                   "leave this device.")
@click.option("--eval-data", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Held-out images for the federation's evaluation (default: a share of --data).")
@click.option("--eval-fraction", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.2,
              show_default=True, help="Share of each class of --data held out for evaluation (without --eval-data).")
@click.option("--root-certificates", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="The federation's CA certificate (ca.crt from `fedmvp certs`).")
@click.option("--auth-key", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="This device's private key, where the server admits only registered nodes.")
@click.option("--insecure", is_flag=True, help="No TLS (a trial against `fedmvp serve --insecure`).")
@click.option("--device", type=click.Choice(DEVICES, case_sensitive=False), default="auto", show_default=True,
              help="Where to train (auto: CUDA when torch sees a GPU).")
@click.option("--max-memory-gb", type=click.FloatRange(min=0, min_open=True), default=None,
              help="GPU memory (GiB) the automatic batch size may use (default: 90% of what is free).")
@click.option("--epochs", type=click.IntRange(min=1), default=1, show_default=True, help="Local epochs per round.")
@_option("--lr", name="lr", type=click.FloatRange(min=0, min_open=True))
@_option("--optimizer", name="optimizer", type=click.Choice(OPTIMIZERS, case_sensitive=False))
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), default=None, metavar="DIR",
              help="Also keep each round's update file in DIR (default: none is kept; the reply carries the "
                   "trained LoRA from memory).")
@click.option("--personalise", is_flag=True,
              help="Also make each round's result this device's own LoRA for `edge-client infer` (default: the "
                   "device's personal LoRA is left alone).")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads for training and inference.")
@click.option("--port", type=click.IntRange(1, 65535), default=None,
              help="Local port of the SuperNode's own API (default: a free one).")
@click.option("--break-lock", is_flag=True,
              help="Take over the bundle's lock (BUNDLE/.lock) when its record names a process on ANOTHER host "
                   "that you know is gone; without it such a lock is refused before the node starts (exit 2).")
@runtime_options
def join(superlink: str, bundle: BundleDir, data: Path, eval_data: Path | None, eval_fraction: float,
         root_certificates: Path | None, auth_key: Path | None, insecure: bool, device: str,
         max_memory_gb: float | None, epochs: int, lr: float, optimizer: str, out: Path | None, personalise: bool,
         threads: int | None, port: int | None, break_lock: bool, runtime: str, precision: str) -> None:
    """Join a federation as an edge device: each round it is asked, train the global LoRA on DATA.

    Runs a Flower SuperNode, one line per round it takes part in, until the run ends (`run R
    ended on the server; leaving`, exit 0) or it is stopped (Ctrl-C). Only LoRA tensors, the
    number of images and the evaluation counts are sent; images stay here. Exit codes: 2 for bad
    arguments (checked before anything starts) or no --auth-key where the server admits only
    listed keys, then Flower's own."""
    from edge_client.bundle import Bundle, BundleError
    from edge_client.node import EdgeNodeConfig
    from edge_client.runtime import ProviderError

    try:
        node = EdgeNodeConfig(bundle=Bundle.resolve_dir(bundle).resolve(), data=data.resolve(),
                              eval_data=eval_data.resolve() if eval_data else None, eval_fraction=eval_fraction,
                              out=out.resolve() if out else None, personalise=personalise, device=device.lower(),
                              max_memory_gb=max_memory_gb, epochs=epochs, lr=lr, optimizer=optimizer.lower(),
                              threads=threads, runtime=runtime.lower(), precision=precision.lower())
        node.options(1)  # the training options are valid (TrainInputError otherwise)
        summary = check_node(node, break_lock)
        args = supernode_command(superlink, node.to_node_config(), root_certificates, auth_key, insecure, port,
                                 install=EDGE_JOIN_INSTALL)
    except (TrainInputError, BundleError, LaunchError, ProviderError) as err:
        click.echo(f"error: {' '.join(str(err).split())}", err=True)
        sys.exit(2)
    click.echo(f"edge node: bundle {summary['bundle']} (round {summary['round']}), {summary['train_images']} "
               f"training and {summary['eval_images']} held-out images of {summary['classes']} classes; "
               f"evaluating on --runtime {node.runtime} --precision {node.precision}; connecting to {superlink}",
               err=True)
    if insecure:
        click.echo("warning: --insecure: no TLS; use it only for a trial", err=True)
    become_supernode(args, "edge-client join")
