"""A token for the simulation's Ray cluster: nothing another process could attach to without it.

Why: Flower's simulation engine starts a Ray cluster whose GCS, raylets, workers and runtime-env agent
listen on every address of the machine (Ray binds its gRPC servers to all interfaces, whatever node
address it is given), and without authentication anyone who can reach a port can attach and run code as
the user. Ray's token authentication (``RAY_AUTH_MODE=token``, Ray >= 2.52) makes every one of those
listeners, gRPC and HTTP, refuse a caller without the token. docs/security.md, "Listeners".

Ray reads the mode and the token once per process, when it is first imported, so the token is the
process's: drawn once (256 random bits) into a 0600 file of a 0700 folder that is removed when the
process exits, and named by path (``RAY_AUTH_TOKEN_PATH``), so it is never in a command line or the
run's records. A process whose environment already asks for token authentication (the user's own
token, or a parent fedmvp process's) keeps it. A process that imported Ray before without it cannot
be given one; its simulation is refused with one line rather than started open.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

TOKEN_FILE = "ray-token"
MODE, PATH, VALUE = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN"


class RayTokenError(RuntimeError):
    """Ray was loaded in this process without token authentication; the message is one line."""


def token_is_set() -> bool:
    """This process's environment asks Ray for token authentication and gives a token."""
    return os.environ.get(MODE) == "token" and bool(os.environ.get(PATH) or os.environ.get(VALUE))


def ensure_ray_token() -> None:
    """Make the Ray cluster this process starts require a token (see the module's docstring)."""
    if token_is_set():
        return
    if "ray._raylet" in sys.modules:
        raise RayTokenError("Ray was loaded in this process before fedmvp could give its cluster a token, so its "
                            "listeners would be open to the network; start the simulation in a fresh process "
                            "(`fedmvp train`), or set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH before Ray loads "
                            "(docs/security.md, \"Listeners\")")
    folder = Path(tempfile.mkdtemp(prefix="fedmvp-ray-"))  # 0700
    path = folder / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secrets.token_hex(32).encode("ascii"))
    finally:
        os.close(fd)
    atexit.register(shutil.rmtree, folder, True)
    os.environ[MODE], os.environ[PATH] = "token", str(path)
