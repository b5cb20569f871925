"""The one SuperNode launch: `fedmvp join` (a site) and `edge-client join` (an edge device).

Both become Flower's ``flower-supernode`` (exec: signals, exit code and output are Flower's from
then on) with the same checks first (address, certificates, key), the same quiet environment and a
free local port for the SuperNode's own API; only the node config differs (a site's
``partition-id``, an edge device's ``role='edge'``, built by each command). This module imports
neither ``fedmvp`` nor torch: an edge install (docs/architecture.md) has no training core.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

from fedmvp_formats.flower_env import FLOWER_QUIET_ENV

# Every deployed Flower process (SuperLink, SuperExec, SuperNodes): Flower quiet, and no model hub
# download behind the operator's back (CLIP loads offline first, docs/architecture.md).
QUIET_ENV = {**FLOWER_QUIET_ENV, "HF_HUB_OFFLINE": "1"}


class LaunchError(RuntimeError):
    """A Flower process could not be started (its executable is missing); one line."""


class LaunchInputError(LaunchError):
    """Bad launch arguments (address, certificates, key): nothing was started."""


def executable(name: str, install: str = "fedmvp[train]") -> str:
    """A Flower executable of this interpreter's environment, else one on PATH (``install``: the hint)."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.is_file() else shutil.which(name)
    if not found:
        raise LaunchError(f"{name} not found: install {install} (it brings flwr) on this machine")
    return found


def split_address(address: str, flag: str = "--superlink") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as host and port; ``flag`` names the option in the error."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchInputError(f"{flag} {address!r}: expected HOST:PORT, e.g. 10.0.0.5:9092")
    return host.strip("[]"), int(port)


def free_port() -> int:
    """A local TCP port nobody listens on now (the SuperNode's own API; tests' servers)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def supernode_command(superlink: str, node_config: str, root_certificates: Path | None = None,
                      auth_key: Path | None = None, insecure: bool = False, port: int | None = None,
                      install: str = "fedmvp[train]") -> list[str]:
    """The ``flower-supernode`` command line (every argument checked before anything starts)."""
    split_address(superlink)
    if insecure == (root_certificates is not None):
        raise LaunchInputError("give --root-certificates CA.crt (the federation's CA) or, for a trial, --insecure")
    for label, path in (("--root-certificates", root_certificates), ("--auth-key", auth_key)):
        if path is not None and not Path(path).is_file():
            raise LaunchInputError(f"{label} {path}: no such file")
    if auth_key is not None and insecure:
        raise LaunchInputError("--auth-key needs TLS: drop --insecure and give --root-certificates")
    args = [executable("flower-supernode", install), "--superlink", superlink, "--node-config", node_config,
            "--port", str(port or free_port())]
    args += ["--insecure"] if insecure else ["--root-certificates", str(root_certificates)]
    if auth_key is not None:
        args += ["--auth-supernode-private-key", str(auth_key)]
    return args


def become_supernode(args: list[str]) -> None:
    """Become the SuperNode (exec): signals, exit code and output are Flower's own from here on."""
    os.execve(args[0], args, {**os.environ, **QUIET_ENV})
