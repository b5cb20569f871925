"""`fedmvp serve`: a Flower SuperLink, the FedMVP run submitted to it, progress, and a clean stop.

The SuperLink is Flower's own (``flower-superlink``), started through
`fedmvp_apps.deploy.superlink_process` so that its Control API admits only this command (an operator
token, docs/security.md), with TLS from a certificate folder (``fedmvp certs``) unless
``--insecure`` is asked for. With TLS, SuperNode authentication is on: only the public keys of a
``--node-keys`` file are admitted, unless ``--allow-any-node`` says otherwise. The ServerApp runs
under a SuperExec that `serve` starts itself and that signs its Runtime API calls with a shared
secret (Flower's ``--isolation process`` + ``--superexec-auth-secret-file``), so nobody else who
reaches the port can claim the run's ServerApp task; that SuperExec
(`fedmvp_apps.deploy.superexec_process`) hands the ServerApp its Runtime API token on a pipe, never
on a command line. Ctrl-C or SIGTERM stops the run, then every process `serve` started, within
`fedmvp_apps.deploy.stopping.STOP_BOUND` seconds. Offline (no runtime dependency installation,
no telemetry). The run is submitted with ``flwr run`` from the app folder of
`fedmvp_apps.deploy.flower_app` (the one definition of the Flower app: it names the installed
Flower apps, the FAB carries no code), and its ``run-dir`` is absolute: the ServerApp
writes the run there, and resumes it when the same command is started again after a crash.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fedmvp_apps.deploy.flower_app import write_app_dir
from fedmvp_apps.deploy.stopping import Interrupted, Stopper, run_interruptible, stop_processes
from fedmvp_apps.deploy.supernode_process import IDLE_PULL_SECONDS, RUN_END_CONFIRM
from fedmvp_apps.deploy.supernode import QUIET_ENV, LaunchError, LaunchInputError, check_free, executable, \
    split_address

CONNECTION = "fedmvp-serve"
CERT_FILES = ("ca.crt", "server.pem", "server.key")
FAILED_LOG_LINES = 15  # of a failed run's ServerApp log, printed by `serve`
SUPEREXEC_MODULE = "fedmvp_apps.deploy.superexec_process"  # flower-superexec, the ServerApp's token on a pipe
ANY_NODE_WARNING = ("warning: --allow-any-node: any SuperNode that trusts the CA may join and have its replies "
                    "averaged; give --node-keys to admit only your sites")


class ServeError(LaunchError):
    """The federation could not be served; one line (the SuperLink's log is named where it helps)."""


class ServeInputError(ServeError, LaunchInputError):
    """Bad arguments (address, certificate folder, flags that exclude each other): nothing was started."""


@dataclass
class ServeOptions:
    """What `fedmvp serve` was asked for."""

    preset: str
    run_dir: Path
    rounds: int | None = None
    min_nodes: int | None = None
    fraction: float | None = None
    round_timeout: float | None = None
    mode: str | None = None  # [server] mode for this start (None: the run's)
    eval_every: int = 0
    certs: Path | None = None
    insecure: bool = False
    node_keys: Path | None = None
    allow_any_node: bool = False
    address: str = "0.0.0.0:9092"
    start_timeout: float = 60.0


def check_certs(certs: Path) -> dict[str, Path]:
    files = {name: certs / name for name in CERT_FILES}
    missing = [name for name, path in files.items() if not path.is_file()]
    if missing:
        raise ServeInputError(f"{certs}: missing {', '.join(missing)} (write them with `fedmvp certs --out {certs}` "
                         f"or bring your own; --insecure for a trial without TLS)")
    return files


def _output(done: subprocess.CompletedProcess) -> str:
    """A flwr command's output as one short line."""
    return " ".join((done.stdout + done.stderr).split())[-300:]


def _toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def flower_home(run_dir: Path) -> Path:
    """Where `fedmvp serve` keeps the SuperLink's state for ``run_dir`` (its database: ``superlink.db``)."""
    run_dir = run_dir.resolve()
    return run_dir.parent / f".{run_dir.name}.flwr"


class Server:
    """One SuperLink process and the `flwr` CLI pointed at it (its own FLWR_HOME)."""

    def __init__(self, options: ServeOptions, stopper: Stopper | None = None):
        self.options = options
        self.stopper = stopper
        run_dir = options.run_dir.resolve()
        self.home = flower_home(run_dir)
        self.log_path = run_dir.parent / f"{run_dir.name}.superlink.log"
        self.proc: subprocess.Popen | None = None
        self.host, self.port = split_address(options.address, "--address")
        self.certs = None if options.insecure else check_certs((options.certs or Path("certs")).resolve())
        if options.node_keys and options.insecure:
            raise ServeInputError("--node-keys needs TLS: SuperNode authentication runs over TLS only (drop --insecure)")
        if options.allow_any_node and (options.insecure or options.node_keys):
            raise ServeInputError("--allow-any-node goes with TLS and without --node-keys "
                                  "(--insecure already admits any node; --node-keys admits only those keys)")
        if self.certs is not None and not options.node_keys and not options.allow_any_node:
            raise ServeInputError("with TLS, give --node-keys FILE (the sites' public keys: `fedmvp certs --nodes N` "
                                  "writes node-keys.txt); --allow-any-node admits any SuperNode that trusts the CA")
        self.superexec: subprocess.Popen | None = None
        self.operator_token = ""
        self.status_client = None  # run_status.RunStatusClient once asked; False: this Flower has none
        self.submit_note: str | None = None  # why the run went through `flwr run`, not this process
        self.link = f"{'127.0.0.1' if self.host in ('0.0.0.0', '::', '') else self.host}:{self.port}"
        # Flower 1.42's SuperLink opens this one port (Fleet, Control and Runtime APIs alike): taken, it would
        # die at start while `serve` connected to whoever holds it (docs/tutorials/across-machines.md, "Checked before anything starts").
        check_free(self.host, self.port, "--address")

    def env(self) -> dict[str, str]:
        return {**os.environ, **QUIET_ENV, "FLWR_HOME": str(self.home)}

    def start(self) -> None:
        """The SuperLink (operator-only Control API), then the SuperExec that runs the ServerApp."""
        from fedmvp_apps.deploy.control_auth import TOKEN_FILE_ENV, store_cli_credentials, write_operator_token

        self.home.mkdir(parents=True, exist_ok=True)
        # A fresh operator token and SuperExec secret per start: nothing from an earlier start stays valid.
        token_file, secret_file = self.home / "operator.token", self.home / "superexec.secret"
        self.operator_token = write_operator_token(token_file)
        store_cli_credentials(self.home, self.link, self.operator_token)
        write_operator_token(secret_file)
        # The SuperLink's state (nodes, runs) in a file beside the run: restarted after a crash, it still
        # knows the SuperNodes, which then carry on instead of failing to reconnect.
        args = [sys.executable, "-m", "fedmvp_apps.deploy.superlink_process", "--host", self.host,
                "--port", str(self.port), "--database", str(self.home / "superlink.db"),
                "--disable-runtime-dependency-installation", "--isolation", "process",
                "--superexec-auth-secret-file", str(secret_file)]
        args += self.tls_args("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile")
        if self.options.node_keys:
            args.append("--enable-supernode-auth")
        tls = 'insecure = true' if self.certs is None else \
            f'root-certificates = {_toml_string(str(self.certs["ca.crt"].resolve()))}'
        (self.home / "config.toml").write_text(f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
                                               f'address = "{self.link}"\n{tls}\n')
        with open(self.log_path, "ab") as log:  # in our process group: Ctrl-C or a kill of the group ends it too
            self.log_start = log.tell()
            self.proc = subprocess.Popen(args, env={**self.env(), TOKEN_FILE_ENV: str(token_file)}, stdout=log,
                                         stderr=subprocess.STDOUT)
        self._wait_listening()
        executable("flower-superexec")  # Flower is installed here (else one line: what to install)
        superexec = [sys.executable, "-m", SUPEREXEC_MODULE, "--runtime-api-address", self.link,
                     "--superexec-auth-secret-file", str(secret_file), "--parent-pid", str(self.proc.pid)]
        superexec += ["--root-certificates", str(self.certs["ca.crt"])] if self.certs else ["--insecure"]
        with open(self.log_path, "ab") as log:
            self.superexec = subprocess.Popen(superexec, env=self.env(), stdout=log, stderr=subprocess.STDOUT)

    def tls_args(self, ca: str, cert: str, key: str) -> list[str]:
        if self.certs is None:
            return ["--insecure"]
        return [ca, str(self.certs["ca.crt"]), cert, str(self.certs["server.pem"]), key, str(self.certs["server.key"])]

    def _wait_listening(self) -> None:
        assert self.proc is not None
        host, port = split_address(self.link, "--address")
        deadline = time.monotonic() + self.options.start_timeout
        while True:
            if self.proc.poll() is not None:
                self.startup_failure()
            with socket.socket() as sock:
                sock.settimeout(0.5)
                if sock.connect_ex((host, port)) == 0:
                    break
            if time.monotonic() > deadline:
                raise ServeError(f"the SuperLink did not listen on {self.link} within "
                                 f"{self.options.start_timeout:g} s; see {self.log_path}")
            self.sleep(0.3)
        self.sleep(0.3)  # someone else's listener answers too: the SuperLink must still be running after it
        if self.proc.poll() is not None:
            self.startup_failure()

    def startup_failure(self) -> None:
        """The SuperLink exited at start: why, in one line (the port taken since `check_free`: exit 2)."""
        assert self.proc is not None
        try:
            with open(self.log_path, "rb") as log:
                log.seek(getattr(self, "log_start", 0))
                said = log.read().decode("utf-8", "replace")
        except OSError:
            said = ""
        if "already in use" in said.lower():
            raise ServeInputError(f"--address {self.options.address}: {self.link} is already in use (another "
                                  f"SuperLink or program listens there); stop it or give another --address")
        raise ServeError(f"the SuperLink exited at start (code {self.proc.returncode}); see {self.log_path}")

    def sleep(self, seconds: float) -> None:
        if self.stopper is not None:
            self.stopper.sleep(seconds)
        else:
            time.sleep(seconds)

    def flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """One `flwr` command; a stop (Ctrl-C) ends it at once (`stopping.Interrupted`)."""
        return run_interruptible([executable("flwr"), *args], self.stopper, timeout, env=self.env(), cwd=self.home)

    def register_nodes(self, keys: list[str]) -> None:
        """Admit exactly these SuperNodes (their public keys): register the new ones, unregister those
        no longer listed. The SuperLink keeps registrations in its database across restarts, so a
        rotated-out key must be removed, not merely left out; ``registered.json`` maps each key we
        registered to its node id."""
        folder = self.home / "node-keys"
        folder.mkdir(exist_ok=True)
        book_path = folder / "registered.json"
        book: dict[str, int] = json.loads(book_path.read_text()) if book_path.is_file() else {}
        for key, node_id in sorted(book.items()):
            if key not in keys:
                done = self.flwr("supernode", "unregister", str(node_id), CONNECTION, "--format", "json")
                if done.returncode != 0 and "not found" not in done.stdout.lower():
                    raise ServeError(f"unregistering a rotated-out SuperNode key failed: {_output(done)}")
                del book[key]
        for i, key in enumerate(keys):
            if key in book:
                continue
            path = folder / f"node-{i}.pub"
            path.write_text(key + "\n")
            try:  # in this process (run_status); the `flwr` command says why where that fails
                book[key] = self.client().register_node(key)
                book_path.write_text(json.dumps(book, indent=2, sort_keys=True) + "\n")
                continue
            except Exception:  # noqa: BLE001 - no client, a key in use, a refused call: the command decides
                pass
            done = self.flwr("supernode", "register", str(path), CONNECTION, "--format", "json")
            try:
                book[key] = int(json.loads(done.stdout)["node-id"])
            except (ValueError, KeyError, TypeError):
                if "already in use" not in _output(done):
                    raise ServeError(f"registering SuperNode key {i + 1} failed: {_output(done)}") from None
            book_path.write_text(json.dumps(book, indent=2, sort_keys=True) + "\n")

    def submit(self) -> int:
        o = self.options
        # A preset file by its absolute path: the ServerApp does not resolve it against this command's folder.
        preset = str(Path(o.preset).resolve()) if Path(o.preset).suffix == ".toml" else o.preset
        config = {"run-dir": str(o.run_dir.resolve()), "preset": preset, "rounds": o.rounds or 0,
                  "eval-every": o.eval_every, "min-nodes": o.min_nodes or 0,
                  "round-timeout": float(o.round_timeout or 0.0), "fraction": float(o.fraction or 0.0),
                  "mode": o.mode or ""}
        text = " ".join(f"{k}={_toml_string(v) if isinstance(v, str) else v}" for k, v in config.items())
        app = write_app_dir(self.home / "app")
        # In this process (run_status); the `flwr run` command only where this Flower lacks what it uses (nothing
        # was sent). A call that was sent and failed is not repeated: the SuperLink may have started the run.
        try:
            if self.client() is not None:
                return self.client().start_run(app, text)
            self.submit_note = "this Flower has no Control API client"
        except (ImportError, AttributeError) as err:
            self.submit_note = " ".join(str(err).split())[:200] or type(err).__name__
        except Exception as err:  # noqa: BLE001 - refused, timed out: one line, the same command resumes
            raise ServeError(f"submitting the run failed: {' '.join(str(err).split())[:300]}") from None
        started = self.flwr("run", str(app), CONNECTION, "--run-config", text, "--format", "json")
        try:
            return int(json.loads(started.stdout)["run-id"])
        except (ValueError, KeyError, TypeError):
            raise ServeError(f"flwr run failed: {' '.join((started.stdout + started.stderr).split())[-400:]}") from None

    def status(self, run_id: int) -> str:
        """Flower's status text of the run ("running", "finished:completed"): asked in this process
        (`run_status`), through `flwr ls` where this Flower lacks the client that needs."""
        if self.client() is not None:
            try:
                return self.status_client.status(run_id)
            except Exception:  # noqa: BLE001 - a refused or broken look: `flwr ls` says it this time
                pass
        listed = self.flwr("ls", CONNECTION, "--run-id", str(run_id), "--format", "json", timeout=60)
        try:
            return str(json.loads(listed.stdout)["runs"][0]["status"])
        except (ValueError, KeyError, IndexError, TypeError):
            return "unknown"

    def client(self):
        """The in-process Control API client (`run_status`); None where this Flower lacks it."""
        if self.status_client is None:
            try:
                from fedmvp_apps.deploy.run_status import RunStatusClient

                self.status_client = RunStatusClient(self.link, self.operator_token,
                                                     self.certs["ca.crt"] if self.certs else None)
            except ImportError:
                self.status_client = False
        return self.status_client or None

    def run_log(self, run_id: int) -> str:
        """The ServerApp's own output (`flwr log --show`), kept by the SuperLink, not in any file of ours;
        appended to the SuperLink's log file so a failed run's error is on disk too."""
        try:
            shown = self.flwr("log", str(run_id), CONNECTION, "--show", timeout=60)
        except subprocess.TimeoutExpired:
            return ""
        text = shown.stdout.strip()
        if text:
            with open(self.log_path, "a", encoding="utf-8") as log:
                log.write(f"\n--- the ServerApp's log of run {run_id} (flwr log) ---\n{text}\n")
        return text

    def stop_run(self, run_id: int) -> bool:
        """Ask the SuperLink to stop run ``run_id`` (the operator's `flwr stop`, in this process where it
        can: a stop is on the clock); True if it did."""
        if self.proc is None or self.proc.poll() is not None:
            return False  # the SuperLink is gone (a Ctrl-C in its terminal reaches it too): nobody to ask
        if self.client() is not None:
            try:
                return self.client().stop(run_id)
            except Exception:  # noqa: BLE001 - a SuperLink shutting down: no second try within the bound
                return False
        try:
            done = run_interruptible([executable("flwr"), "stop", str(run_id), CONNECTION, "--format", "json"], None,
                                     self.stopper.left() if self.stopper else 30, env=self.env(), cwd=self.home)
        except subprocess.TimeoutExpired:
            return False
        try:  # `flwr --format json` exits 0 on a refusal too: its JSON says whether it worked
            return json.loads(done.stdout).get("success") is True
        except (ValueError, AttributeError):
            return False

    def stop(self) -> None:
        """SIGTERM the SuperExec, the SuperLink and the ServerApp together; past the stop's deadline,
        SIGKILL what is left (`stopping.stop_processes`)."""
        if self.status_client:
            self.status_client.close()
            self.status_client = None
        procs = [proc for proc in (self.superexec, self.proc) if proc is not None]
        stop_processes(procs, within=self.stopper.left() if self.stopper is not None else 10.0)


# Seconds the SuperLink outlives its run, so that its nodes hear the end twice, RUN_END_CONFIRM apart, and leave
# (supernode_process.RunWatch): an idle node asks only between two empty pulls, IDLE_PULL_SECONDS apart, so it
# first hears the end up to one pull late and again at the first pull RUN_END_CONFIRM later; plus 1.5 s for
# requests on a loaded machine. (3 s, shorter than two idle pulls, left a node whose pulls fell late polling a
# SuperLink that was gone.)
RUN_END_NOTICE = IDLE_PULL_SECONDS + max(IDLE_PULL_SECONDS, RUN_END_CONFIRM) + 1.5
# (supernode_process.RunWatch); an interrupted serve stops the SuperLink at once, so its sites stay for the resume


def serve(options: ServeOptions, on_progress: Callable[[int, str], None] | None = None,
          on_event: Callable[[str], None] | None = None) -> str:
    """Start the SuperLink, submit the run, wait for it to end, stop the SuperLink; the run's final status.

    ``on_event`` hears each milestone as one line (listening, SuperNode keys admitted, run submitted):
    sites should join once the keys are admitted, as Flower refuses a node it does not know yet.
    ``on_progress(rounds done, status)`` is called about once a second while the run runs, and once more
    when it ended: `fedmvp serve` reads each new round's state.json there (`server_lines.RoundWatch`).
    Interrupted (Ctrl-C, SIGTERM: `stopping.Stopper`), `serve` stops its run on the SuperLink, then every
    process it started, and raises `stopping.Interrupted` with the one line to print, all within
    `stopping.STOP_BOUND` seconds of the signal."""
    say = on_event or (lambda line: None)
    from fedmvp_apps.deploy.certs import read_node_keys
    from fedmvp.runs import RunDir

    keys = read_node_keys(options.node_keys) if options.node_keys else []
    with Stopper("serve: interrupted; the same command resumes the run") as stopper:
        server = Server(options, stopper)
        run = RunDir(options.run_dir)
        run_id = None
        try:
            server.start()
            say(f"SuperLink listening on {options.address} ({'TLS' if server.certs else 'INSECURE, no TLS'}); "
                f"Control API: this command only; log: {server.log_path}")
            if options.allow_any_node:
                say(ANY_NODE_WARNING)
            if keys:
                server.register_nodes(keys)
                say(f"{len(keys)} SuperNode keys admitted: sites may join now")
            run_id = server.submit()
            if server.submit_note:
                say(f"submitted through `flwr run` (in this process: {server.submit_note})")
            say(f"run {run_id} submitted: {options.preset} -> {options.run_dir}")
            status = _watch(server, run, run_id, options, on_progress, say)
            server.sleep(RUN_END_NOTICE)  # its nodes ask whether the run runs: they hear it ended, and leave
            return status
        except Interrupted:
            if run_id is None:
                raise Interrupted(f"interrupted ({stopper.name}) before the run was submitted; the same command "
                                  f"starts it") from None
            stopped = server.stop_run(run_id)
            raise Interrupted(f"interrupted: run {run_id} {'stopped' if stopped else 'could not be stopped'} "
                              f"({stopper.name}); the same command resumes it") from None
        finally:
            server.stop()


def _watch(server: Server, run, run_id: int, options: ServeOptions, on_progress, say) -> str:
    """Look at the run once a second until it ends; its final status. The ServerApp's left-out replies
    (RUN/flower.log) are said as they come."""
    from fedmvp.federated.flower_log import FlowerLogTail

    flower_log = FlowerLogTail(options.run_dir)
    warned = run.last_round() or 0
    while True:
        status = server.status(run_id)
        for line in flower_log.left_out():
            say(line)
        done = run.last_round() or 0
        if on_progress:
            on_progress(done, status)
        if options.allow_any_node and done > warned:
            warned = done
            say(f"round {done}: {ANY_NODE_WARNING}")
        if status.startswith("finished"):
            if flower_log.note():
                say(flower_log.note())
            if status != "finished:completed":
                tail = server.run_log(run_id).splitlines()[-FAILED_LOG_LINES:]
                say(f"run {run_id} {status}; the end of its ServerApp's log (also in {server.log_path}):"
                    + "".join(f"\n  {line}" for line in tail) if tail else
                    f"run {run_id} {status}; its ServerApp left no log (flwr log)")
            return status
        if server.proc is not None and server.proc.poll() is not None:
            raise ServeError(f"the SuperLink stopped during the run; see {server.log_path}")
        server.sleep(1.0)
