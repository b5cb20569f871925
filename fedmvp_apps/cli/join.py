"""`fedmvp join`: this machine as one site of a federation (a Flower SuperNode)."""

from __future__ import annotations

from pathlib import Path

import click

from fedmvp_apps.cli.common import BadInput


@click.command()
@click.option("--superlink", required=True, metavar="HOST:PORT", help="The server's address (`fedmvp serve`).")
@click.option("--config", "config", required=True, metavar="PRESET",
              help="The federation's preset (name or TOML file); its data paths must hold this site's data.")
@click.option("--site", required=True, type=click.IntRange(min=0), help="Which site of the preset this machine is.")
@click.option("--root-certificates", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="The federation's CA certificate (ca.crt from `fedmvp certs`).")
@click.option("--auth-key", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="This node's private key, where the server admits only registered SuperNodes.")
@click.option("--insecure", is_flag=True, help="No TLS (a trial against `fedmvp serve --insecure`).")
@click.option("--port", type=click.IntRange(1, 65535), default=None,
              help="Local port of the SuperNode's own API (default: a free one).")
def join(superlink: str, config: str, site: int, root_certificates: Path | None, auth_key: Path | None,
         insecure: bool, port: int | None) -> None:
    """Serve site SITE of PRESET as a Flower SuperNode connected to SUPERLINK.

    Runs until stopped (Ctrl-C). Images stay on this machine: only trained tensors and
    evaluation counts are sent. Exit codes: Flower's; 2 for bad arguments."""
    from fedmvp.presets.schema import PresetError, load_preset
    from fedmvp_apps.deploy.supernode import LaunchError, become_supernode, supernode_command

    try:
        load_preset(config, check_roots=False)
        args = supernode_command(superlink, site_node_config(config, site), root_certificates, auth_key, insecure,
                                 port)
    except (PresetError, LaunchError) as err:
        raise BadInput(str(err)) from None
    if insecure:
        click.echo("warning: --insecure: no TLS; use it only for a trial", err=True)
    become_supernode(args)


def site_node_config(preset: str, site: int) -> str:
    """A site's node config: which share of the preset it serves (a TOML preset by its absolute path)."""
    if site < 0:
        raise BadInput(f"--site must be >= 0, got {site}")
    preset_value = str(Path(preset).resolve()) if Path(preset).suffix == ".toml" else preset
    return f"partition-id={site} preset={preset_value!r}"
