"""`fedmvp serve` / `fedmvp join` as real processes for the deployment tests (each its own process group)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from tests.deadlines import scaled

FEDMVP = [sys.executable, "-m", "fedmvp_apps.cli"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "FLWR_TELEMETRY_ENABLED": "0"}


def json_result(log: str) -> dict:
    """What a command printed last with --json, out of its log: from the last line that is a lone "{" (the
    top level: a nested object's "{" ends a line that holds its key, or is indented) to the end."""
    tops = [m.start() for m in re.finditer(r"^\{\n", log, re.M)]
    return json.loads(log[tops[-1]:])


class Processes:
    """Started commands with their logs; ``stop`` ends every one of them, whatever happened."""

    def __init__(self, root: Path):
        self.root = root
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, args: list[str], command: list[str] | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        """``command`` (default ``python -m fedmvp_apps.cli``) with ``args``, logged to NAME.log."""
        with open(self.root / f"{name}.log", "ab") as handle:
            proc = subprocess.Popen([*(command or FEDMVP), *args], cwd=self.root, env=env or ENV, stdout=handle,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_for(self, what: str, done, timeout: float, watch: str = "serve") -> None:
        began = time.time()
        deadline = began + scaled(timeout)
        while not done():
            proc = self.procs.get(watch)
            assert proc is None or proc.poll() is None, f"{watch} exited while waiting for {what}\n{self.log(watch)}"
            assert time.time() < deadline, f"no {what} within {scaled(timeout):g} s\n{self.log(watch)[-3000:]}"
            time.sleep(0.3)
        print(f"[{time.strftime('%H:%M:%S')}] {what}: {time.time() - began:.1f} s")  # where a test's time went (-s)

    def start_buffered(self, preset: Path, run: Path, certs: Path, port: int,
                       devices: dict[str, tuple[Path, Path]]) -> None:
        """`fedmvp serve --mode buffered` on ``run`` (TLS, any node, 127.0.0.1:``port``), then one
        `edge-client join` per device name -> (bundle, data), its update files under ROOT/device-NAME/updates."""
        self.start("serve", ["serve", "--config", str(preset), "--run-dir", str(run), "--certs", str(certs),
                             "--allow-any-node", "--address", f"127.0.0.1:{port}", "--min-nodes", "1", "--mode",
                             "buffered", "--json"])
        self.wait_for("SuperLink", lambda: "SuperLink listening" in self.log("serve"), 60)
        for name, (bundle, data) in devices.items():
            self.start(f"edge-{name}", ["--superlink", f"127.0.0.1:{port}", "--bundle", str(bundle), "--data",
                                        str(data), "--root-certificates", str(certs / "ca.crt"), "--out",
                                        str(self.root / f"device-{name}" / "updates"), "--epochs", "1", "--lr", "0.01",
                                        "--optimizer", "adamw", "--eval-fraction", "0.25", "--threads", "1"],
                       command=[str(Path(sys.executable).parent / "edge-client"), "join"])

    def exit_code(self, name: str, timeout: float, run: Path | None = None) -> int:
        """``name``'s exit code once it ended; past ``timeout`` an AssertionError that carries the end of
        every log (and of RUN/flower.log: the ServerApp's warnings), so a run that did not end says where."""
        try:
            began = time.time()
            code = self.procs[name].wait(timeout=scaled(timeout))
            print(f"[{time.strftime('%H:%M:%S')}] {name} exited {code}: {time.time() - began:.1f} s")
            return code
        except subprocess.TimeoutExpired:
            logs = {other: self.log(other)[-2500:] for other in self.procs}
            if run is not None and (run / "flower.log").exists():
                logs["RUN/flower.log"] = (run / "flower.log").read_text(errors="replace")[-2500:]
            raise AssertionError(f"{name} still running after {scaled(timeout):g} s\n" + "\n".join(
                f"--- {other} ---\n{text}" for other, text in logs.items())) from None

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        proc.wait(timeout=scaled(30))

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=scaled(15))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
