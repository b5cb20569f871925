"""The one SuperNode launch: `fedmvp join` (a site) and `edge-client join` (an edge device).

Both start Flower's ``flower-supernode`` (through `fedmvp_apps.deploy.supernode_process`, which
shortens the fixed waits of its main loop) with the same checks first (address, certificates, key),
the same quiet environment and a free local port for the SuperNode's own Runtime API; only the node
config differs (a site's ``partition-id``, an edge device's ``role='edge'``, built by each command).
The SuperNode runs in ``--isolation process``: it starts no ClientApp process per message; the
join's one warm executor (``warm_executor.py``) runs every message in one long-lived process, so a
site loads CLIP and its data once. The join supervises the two: Ctrl-C or SIGTERM (one line, within
`fedmvp_apps.deploy.stopping.STOP_BOUND` seconds), the SuperNode ending or the executor dying stops
both (an executor's death: one line, a non-zero exit). No secret is on a command line or in an
environment: the SuperExec secret is a 0600 file named by path, and the executor receives each
task's token from the SuperNode's Runtime API, in its own memory (docs/security.md).
This module imports neither ``fedmvp`` nor torch: an edge install (docs/architecture.md) has no
training core.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import NoReturn

from fedmvp_apps.deploy.node_lines import FLOWER_LOG_ENV, NO_KEY, NodeLines, key_line, pump, say
from fedmvp_apps.deploy.stopping import Interrupted, Stopper, stop_processes
from fedmvp_formats.flower_env import FLOWER_QUIET_ENV

# Every deployed Flower process (SuperLink, SuperExec, SuperNodes): Flower quiet, and no model hub
# download behind the operator's back (CLIP loads offline first, docs/architecture.md).
QUIET_ENV = {**FLOWER_QUIET_ENV, "HF_HUB_OFFLINE": "1"}
RUNTIME_HOST = "127.0.0.1"  # the SuperNode's Runtime API: only this machine's executor reaches it
STOP_SECONDS = 10  # a stopped process's grace before it is killed (within stopping.STOP_BOUND)
EXECUTOR_MODULE = "fedmvp_apps.deploy.warm_executor"
SUPERNODE_MODULE = "fedmvp_apps.deploy.supernode_process"  # flower-supernode, its loop's waits shortened


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


def check_free(host: str, port: int, flag: str) -> None:
    """Refuse (one line) a port that something listens on already: the Flower process given it would die at
    start with the reason only in its log. SO_REUSEADDR as the listener sets it, so a port whose last
    connections are still closing (TIME_WAIT, a restart) is not taken for one in use."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise LaunchInputError(f"{flag} {host}:{port}: cannot listen there ({err.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise LaunchInputError(f"{flag} {host}:{port}: already in use (another SuperLink, SuperNode or "
                                       f"program listens there); stop it or choose another port") from None
            raise LaunchInputError(f"{flag} {host}:{port}: cannot listen there ({err.strerror})") from None


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
    executable("flower-supernode", install)  # Flower is installed here (else one line: what to install)
    if port is not None:
        check_free(RUNTIME_HOST, port, "--port")
    args = [sys.executable, "-m", SUPERNODE_MODULE, "--superlink", superlink, "--node-config", node_config,
            "--isolation", "process", "--host", RUNTIME_HOST, "--port", str(port or free_port())]
    args += ["--insecure"] if insecure else ["--root-certificates", str(root_certificates)]
    if auth_key is not None:
        args += ["--auth-supernode-private-key", str(auth_key)]
    return args


def become_supernode(args: list[str], command: str = "join", preflight: tuple[str, str] | None = None) -> NoReturn:
    """Run this node until it ends: the SuperNode ``args`` and the warm executor of its ClientApp
    messages, both children of this process, stopped together; exits with the SuperNode's code
    (1 where the executor died). ``command`` names this command in its stop line. ``preflight``
    (a module and its argument): checks the executor runs first, with the libraries its first message
    loads anyway; the SuperNode starts only once they passed (a refusal: its one line, exit 2)."""
    env = {**os.environ, **QUIET_ENV, "PYTHONUNBUFFERED": "1"}
    runtime = f"{RUNTIME_HOST}:{args[args.index('--port') + 1]}"
    address = args[args.index("--superlink") + 1]
    raw = os.environ.get(FLOWER_LOG_ENV)
    lines = NodeLines(address, say, _append(Path(raw)) if raw else None)  # ours, not Flower's log
    piped = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "errors": "replace"}
    with Stopper(f"{command}: stopped; the SuperNode and its executor were killed") as stopper, \
            tempfile.TemporaryDirectory(prefix="fedmvp-node-") as private:
        secret = Path(private) / "superexec.secret"  # only this join's executor may claim the node's tasks
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(secrets.token_bytes(32))
        checks = ["--preflight", preflight[0], "--preflight-arg", preflight[1]] if preflight else []
        executor = subprocess.Popen([sys.executable, "-m", EXECUTOR_MODULE, "--runtime-api-address", runtime,
                                     "--secret-file", str(secret), "--parent-pid", str(os.getpid()), *checks],
                                    env=env, preexec_fn=_die_with_parent, **piped)
        if preflight:
            await_preflight(executor, stopper, command)
        say(f"trying the SuperLink at {address}; this node keeps trying until it answers (Ctrl-C stops)")
        supernode = subprocess.Popen([*args, "--superexec-auth-secret-file", str(secret)], env=env,
                                     preexec_fn=_die_with_parent, **piped)
        readers = [pump(supernode.stdout, "supernode", lines), pump(executor.stdout, "executor", lines)]
        code = supervise(supernode, executor, stopper, command)
        for reader in readers:  # the last lines (the run-end line, Flower's error) before this one's
            reader.join(timeout=2)
    if code and lines.key_refused:  # Flower's "must be registered via the CLI", said as what to do
        say(key_line(command, address, lines.key_refused))
        code = 2 if lines.key_refused == NO_KEY else code  # no --auth-key: bad input (node_lines.key_line)
    sys.exit(code)


def await_preflight(executor: subprocess.Popen, stopper: Stopper, command: str) -> None:
    """Read the executor's preflight answer (warnings before it go to stderr as they come). Return when
    it passed; else exit: 2 with its one line where it refused, the executor's code where it died, 0 on
    Ctrl-C or SIGTERM. Nothing has connected in any of these."""
    from fedmvp_apps.deploy.preflight import PASSED as PREFLIGHT_PASSED
    from fedmvp_apps.deploy.preflight import REFUSED as PREFLIGHT_REFUSED

    answer: list[str] = []

    def read() -> None:
        for line in iter(executor.stdout.readline, ""):
            if line.startswith((PREFLIGHT_PASSED, PREFLIGHT_REFUSED)):
                answer.append(line.rstrip("\n"))
                return
            print(line, end="", file=sys.stderr, flush=True)  # the checks' own warning lines

    reader = threading.Thread(target=read, daemon=True, name="preflight")
    reader.start()
    try:
        while reader.is_alive():
            stopper.sleep(0.1)
    except Interrupted:
        stop_processes([executor], stopper.left())
        print(f"{command}: stopped ({stopper.name}) before it connected", file=sys.stderr, flush=True)
        sys.exit(0)
    if answer and answer[0].startswith(PREFLIGHT_PASSED):
        return
    code = executor.wait()
    if answer:
        print(f"error: {answer[0][len(PREFLIGHT_REFUSED):]}", file=sys.stderr, flush=True)
        sys.exit(2)
    print(f"error: the ClientApp executor (pid {executor.pid}) exited with code {code} while checking this "
          f"site", file=sys.stderr, flush=True)
    sys.exit(code or 1)


def supervise(supernode: subprocess.Popen, executor: subprocess.Popen, stopper: Stopper,
              command: str = "join") -> int:
    """Wait until one of the two ends or ``stopper`` hears Ctrl-C or SIGTERM, then stop the other, or
    both: within the stop's bound (`stopping.STOP_BOUND`), with one line."""
    try:
        while True:
            if supernode.poll() is not None:
                stop_processes([executor], STOP_SECONDS)
                return supernode.returncode
            if executor.poll() is not None:
                print(f"error: the ClientApp executor (pid {executor.pid}) exited with code "
                      f"{executor.returncode}; stopping the SuperNode", file=sys.stderr, flush=True)
                stop_processes([supernode], STOP_SECONDS)
                return executor.returncode or 1
            stopper.sleep(0.2)
    except Interrupted:
        stop_processes([executor, supernode], stopper.left())
        print(f"{command}: stopped ({stopper.name}); this node left the federation (the same command joins "
              f"again)", file=sys.stderr, flush=True)
        return supernode.returncode if supernode.returncode and supernode.returncode > 0 else 0


def _append(path: Path):
    """``path`` opened to append, not through a link (docs/security.md); a bad path: one line, exit 2."""
    from fedmvp_formats.nofollow import append_nofollow

    try:
        return append_nofollow(path, 0o600)
    except OSError as err:
        print(f"error: {FLOWER_LOG_ENV}={path}: cannot append there ({err.strerror or err})", file=sys.stderr)
        sys.exit(2)


def _die_with_parent() -> None:
    """In the child (Linux): end when the join is killed outright, so nothing is left running."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass
