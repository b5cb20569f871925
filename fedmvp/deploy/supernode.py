"""`fedmvp join`: this machine as one site of the federation, a Flower SuperNode.

The node serves site N of the preset's partition (``partition-id``) with the data on this machine,
trusts the federation's CA (``--root-certificates``) and, where the SuperLink admits only
registered SuperNodes, signs in with its private key (``--auth-key``). Images never leave the
machine: only the trained tensors and the evaluation counts go back.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from fedmvp.deploy.superlink import QUIET_ENV, ServeInputError, executable, split_address


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def supernode_command(superlink: str, preset: str, site: int, root_certificates: Path | None = None,
                      auth_key: Path | None = None, insecure: bool = False, port: int | None = None) -> list[str]:
    """The ``flower-supernode`` command line for site ``site`` (checked before anything starts)."""
    split_address(superlink)
    if site < 0:
        raise ServeInputError(f"--site must be >= 0, got {site}")
    if insecure == (root_certificates is not None):
        raise ServeInputError("give --root-certificates CA.crt (the federation's CA) or, for a trial, --insecure")
    for label, path in (("--root-certificates", root_certificates), ("--auth-key", auth_key)):
        if path is not None and not Path(path).is_file():
            raise ServeInputError(f"{label} {path}: no such file")
    if auth_key is not None and insecure:
        raise ServeInputError("--auth-key needs TLS: drop --insecure and give --root-certificates")
    preset_value = str(Path(preset).resolve()) if Path(preset).suffix == ".toml" else preset
    args = [executable("flower-supernode"), "--superlink", superlink,
            "--node-config", f"partition-id={site} preset={preset_value!r}",
            "--port", str(port or free_port())]
    args += ["--insecure"] if insecure else ["--root-certificates", str(root_certificates)]
    if auth_key is not None:
        args += ["--auth-supernode-private-key", str(auth_key)]
    return args


def join(args: list[str]) -> None:
    """Become the SuperNode (exec): signals, exit code and output are Flower's own from here on."""
    os.execve(args[0], args, {**os.environ, **QUIET_ENV})
