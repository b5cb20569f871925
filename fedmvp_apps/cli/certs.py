"""`fedmvp certs`: a CA, a SuperLink certificate and SuperNode keys for a trial or a small federation."""

from __future__ import annotations

from pathlib import Path

import click

from fedmvp_apps.cli.common import BadInput, emit_json


@click.command()
@click.option("--out", "out", required=True, type=click.Path(path_type=Path, file_okay=False),
              help="Folder to write ca.crt/ca.key, server.pem/server.key and the node keys into.")
@click.option("--host", "hosts", multiple=True,
              help="Name or IP address the SuperNodes use to reach the SuperLink (repeatable); "
                   "localhost and 127.0.0.1 are always included.")
@click.option("--nodes", type=click.IntRange(min=0), default=0, show_default=True,
              help="Also write this many SuperNode key pairs (node-N, node-N.pub) and node-keys.txt "
                   "(what `fedmvp serve --node-keys` admits).")
@click.option("--force", is_flag=True, help="Replace the files of an existing CA in --out.")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
def certs(out: Path, hosts: tuple[str, ...], nodes: int, force: bool, as_json: bool) -> None:
    """Write a private CA, a TLS certificate for the SuperLink signed by it, and (with --nodes)
    SuperNode key pairs for node authentication. For trials and small sites: production
    federations bring certificates from their own CA (docs/tutorials/across-machines.md).

    \b
    Copy to each site: ca.crt, and with node authentication its own node-N (private key).
    Keep on the server: server.pem, server.key, node-keys.txt. Keep ca.key offline."""
    from fedmvp_apps.deploy.certs import CertsError, write_certs

    try:
        files = write_certs(out, list(hosts), nodes, force=force)
    except CertsError as err:
        raise BadInput(str(err)) from None
    if as_json:
        emit_json(files.to_json())
        return
    click.echo(f"CA:          {files.ca_cert} (key {files.ca_key}: keep it offline)")
    click.echo(f"SuperLink:   {files.server_cert} + {files.server_key}, valid for {', '.join(files.hosts)}")
    if files.node_list:
        click.echo(f"SuperNodes:  {len(files.node_keys)} key pairs node-N / node-N.pub; "
                   f"admitted keys: {files.node_list}")
