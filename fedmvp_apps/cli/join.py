"""`fedmvp join`: this machine as one site of a federation (a Flower SuperNode).

A paper preset's site is chosen by ``--site N`` (it builds only its own partition); a ``[federation]``
preset's site brings its own folder (``--data DIR``, ``--name NAME``), checked before anything
connects: each problem one line, exit 2 (docs/architecture.md "Sites that hold their own data"). Its
name is one of the preset's [[sites]], or, where the preset lists none, any name: the server numbers
it when it first identifies (docs/architecture.md "Open membership"). ``--threads``: the node config's
``threads``, torch's CPU threads in the site's ClientApp. ``--classes-from-server``: a [federation] site
without a copy of the run's attribute file takes the class set from the server's messages
(``fedmvp.federated.site_classes``); its folder is checked here for all but its class names, which are
matched to the run's when the first message brings them."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import click

from fedmvp_apps.cli.common import BadInput, FiniteFloat, site_folder_error


@click.command()
@click.option("--superlink", required=True, metavar="HOST:PORT", help="The server's address (`fedmvp serve`).")
@click.option("--config", "config", required=True, metavar="PRESET",
              help="The federation's preset (name or TOML file).")
@click.option("--site", type=click.IntRange(min=0), default=None,
              help="A [[datasets]] preset: which site of the preset this machine is (its data paths hold it).")
@click.option("--data", type=click.Path(path_type=Path), default=None,
              help="A [federation] preset: this site's folder DIR/<class>/<image> (or DIR/train + DIR/test).")
@click.option("--name", default=None, help="A [federation] site's name (default: this host's name), its identity "
                                           "in every reply: one of the preset's [[sites]], or any name where the "
                                           "preset lists none (open membership: the server numbers it).")
@click.option("--eval-fraction", type=FiniteFloat(0, 1, min_open=True, max_open=True), default=None,
              help="Share of each class kept for evaluation (default: the preset's eval_fraction, 0.2).")
@click.option("--classes-from-server", is_flag=True,
              help="A [federation] site without a copy of the run's attribute file: take the class names and their "
                   "attribute phrases from the server's messages (checked against the run's class-set digest) and "
                   "say so once (`took the class set from the server`).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads torch uses for this site's training and evaluation (default: torch's own).")
@click.option("--root-certificates", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="The federation's CA certificate (ca.crt from `fedmvp certs`).")
@click.option("--auth-key", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="This node's private key, where the server admits only registered SuperNodes.")
@click.option("--insecure", is_flag=True, help="No TLS (a trial against `fedmvp serve --insecure`).")
@click.option("--port", type=click.IntRange(1, 65535), default=None,
              help="Local port of the SuperNode's own API (default: a free one).")
def join(superlink: str, config: str, site: int | None, data: Path | None, name: str | None,
         eval_fraction: float | None, classes_from_server: bool, threads: int | None, root_certificates: Path | None,
         auth_key: Path | None, insecure: bool, port: int | None) -> None:
    """Serve one site of PRESET as a Flower SuperNode connected to SUPERLINK.

    Prints the address it tries (until the server answers), `connected to ADDRESS` once it did,
    one line per round it takes part in (with --classes-from-server, first `took the class set from the
    server (digest D, N classes)`), and leaves when the run ends (`run R ended on the server;
    leaving`, exit 0) or when stopped (Ctrl-C). Images stay on this machine: only trained tensors
    and evaluation counts are sent. Exit codes: 0 the run ended; 2 for bad arguments, a bad site
    folder or no --auth-key where the server admits only listed keys; else Flower's."""
    from fedmvp.presets.schema import PresetError, load_preset
    from fedmvp.run_classes import class_set_classes
    from fedmvp_apps.cli.join_preflight import MODULE, SiteChecks
    from fedmvp_apps.deploy.supernode import LaunchError, become_supernode, supernode_command
    from fedmvp_formats.messages import THREADS

    preflight = None
    try:
        preset = load_preset(config, check_roots=False)
        if preset.federation is not None:  # a name the preset cannot take: said before the backbone loads
            check_site_name(preset, name or socket.gethostname())
            if not classes_from_server:  # the run's class set is readable here (a missing file: one line, now)
                class_set_classes(preset)
            # The backbone's checks (it loads offline and tells the classes apart; with the class set from
            # the server, it loads) run in the site's executor, before its SuperNode starts (join_preflight).
            preflight = (MODULE, SiteChecks(_preset_value(config), classes_from_server).argument())
        if preset.federation is not None:
            node_config = named_site_node_config(config, data, name or socket.gethostname(), eval_fraction,
                                                 classes_from_server)
        else:
            if data is not None or name is not None or eval_fraction is not None or classes_from_server:
                raise BadInput(f"{config}: --data/--name/--eval-fraction/--classes-from-server need a [federation] "
                               f"preset; this one's sites are chosen by --site N")
            if site is None:
                raise BadInput("--site N is required: which site of the preset this machine is")
            node_config = site_node_config(config, site)
        if threads is not None:  # the node config's threads: the site's ClientApp sets torch's (client_app._threads)
            node_config += f" {THREADS}={threads}"
        if auth_key is not None and preset.federation is not None:  # a named site signs its identity with it
            node_config += f" auth-key={str(auth_key.resolve())!r}"  # (fedmvp.federated.site_keys)
        args = supernode_command(superlink, node_config, root_certificates, auth_key, insecure, port)
    except (PresetError, LaunchError) as err:
        raise BadInput(str(err)) from None
    if insecure:
        click.echo("warning: --insecure: no TLS; use it only for a trial", err=True)
    become_supernode(args, preflight=preflight)


def _preset_value(preset: str) -> str:
    return str(Path(preset).resolve()) if Path(preset).suffix == ".toml" else preset


def site_node_config(preset: str, site: int) -> str:
    """A site's node config: which share of the preset it serves (a TOML preset by its absolute path)."""
    if site < 0:
        raise BadInput(f"--site must be >= 0, got {site}")
    return f"partition-id={site} preset={_preset_value(preset)!r}"


def named_site_node_config(preset: str, data: Path | None, name: str, eval_fraction: float | None,
                           classes_from_server: bool = False) -> str:
    """A named site's node config, once its folder passed every check (each problem one line); taking the
    class set from the server, every check but its class names (`folder_check`)."""
    from fedmvp.data.federation import SiteRequest, load_federation
    from fedmvp.data.site_folder import SiteFolderError
    from fedmvp_formats.messages import SITE_NAME

    from fedmvp.federated.site_classes import FROM_SERVER
    from fedmvp.presets.schema import load_preset

    parsed = load_preset(preset, check_roots=False)
    check_site_name(parsed, name)
    if data is None:
        raise BadInput("--data DIR is required: this site's folder (DIR/<class>/<image>)")
    folder = data.resolve()
    try:
        if classes_from_server:
            copies = folder_check(folder, parsed.federation.eval_fraction if eval_fraction is None else eval_fraction)
        else:
            _, federation = load_federation(preset, SiteRequest(name=name, data=str(folder), eval_fraction=eval_fraction))
            copies = federation.clients[0].duplicate_images
    except SiteFolderError as err:
        raise site_folder_error(err) from None
    if copies:  # what the site reports is what it holds: an image counts once (fedmvp.data.site_folder)
        click.echo(f"warning: {folder}: {copies} file{'s' * (copies != 1)} left out as byte-identical copies of "
                   f"images counted once", err=True)
    parts = [f"{SITE_NAME}={name!r}", f"data={str(folder)!r}", f"preset={_preset_value(preset)!r}"]
    if eval_fraction is not None:
        parts.append(f"eval-fraction={float(eval_fraction)!r}")
    if classes_from_server:
        parts.append(f"{FROM_SERVER}=true")
    return " ".join(parts)


def check_site_name(preset, name: str) -> None:
    """A listed federation's site is one of its [[sites]] (`PresetError` naming them); an open one takes
    any name its server can number (`BadInput`). Reads no folder and loads no model."""
    from fedmvp.data.federation_plan import is_open
    from fedmvp.data.site_federation import site_id
    from fedmvp_formats.messages import site_name_problem as name_problem

    if not is_open(preset):
        site_id(preset, name)
    elif name_problem(name) is not None:
        raise BadInput(f"--name {name!r}: {name_problem(name)}")


def folder_check(folder: Path, eval_fraction: float) -> int:
    """A site folder checked before the run's class set is known: its layout, every class folder not empty,
    every image decoding (`SiteFolderError`); its class names are matched to the run's with the first message.
    Returns the byte-identical copies left out."""
    from fedmvp.data.site_folder import read_site_folder

    split = (folder / "train").is_dir() and (folder / "test").is_dir()
    trees = [folder / "train", folder / "test"] if split else [folder]
    names = sorted({entry.name for tree in trees if tree.is_dir() for entry in os.scandir(tree)
                    if entry.is_dir() and not entry.name.startswith(".")})
    return read_site_folder(folder, names, [], eval_fraction).duplicates
