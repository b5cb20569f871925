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
        deadline = time.time() + timeout
        while not done():
            proc = self.procs.get(watch)
            assert proc is None or proc.poll() is None, f"{watch} exited while waiting for {what}\n{self.log(watch)}"
            assert time.time() < deadline, f"no {what} within {timeout} s\n{self.log(watch)[-3000:]}"
            time.sleep(0.3)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
