"""Shared by the hostile-input tables: run a command as a user would, and prove what it left alone.

Each table row (the peft habit) names the input, the expected exit code, a fragment of the one
line the user reads, and the directories that must be byte-identical afterwards.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Hostile:
    """One row: what is typed, what must come back, what must not change."""

    id: str
    args: list[str]
    exit_code: int
    fragment: str
    unchanged: list[str] = field(default_factory=list)  # paths (relative to the test's root) left as they were


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (or of ``root`` itself), by relative path; {} if absent."""
    root = Path(root)
    if root.is_file():
        return {".": hashlib.sha256(root.read_bytes()).hexdigest()}
    if not root.exists():
        return {}
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def run(command: str, args: list[str], cwd: Path, env: dict[str, str] | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess:
    """A console script of this environment (fedmvp, fedmvp-export, edge-client) as a user runs it."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([str(BIN / command), *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line_error(done: subprocess.CompletedProcess, exit_code: int, fragment: str) -> None:
    """Exit code as promised, no traceback, and the message on one line of stderr (or --json stdout)."""
    output = done.stdout + done.stderr
    assert done.returncode == exit_code, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    lines = [line for line in output.splitlines() if fragment in line]
    assert lines, f"no line contains {fragment!r}:\n{output[-3000:]}"
