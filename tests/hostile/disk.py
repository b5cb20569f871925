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
from tests.deadlines import scaled

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


# The console scripts' click commands: rows run them in this process (a fresh interpreter costs
# about 5 s of importing torch and open_clip per row); ``in_process=False`` runs the real script.
ENTRY_POINTS = {"fedmvp": ("fedmvp_apps.cli", "main"), "fedmvp-export": ("fedmvp_apps.export_cli", "main"),
                "edge-client": ("fedmvp_apps.edge_cli", "main")}


def run(command: str, args: list[str], cwd: Path, env: dict[str, str] | None = None,
        timeout: float = 300, in_process: bool = True) -> subprocess.CompletedProcess:
    """A console script of this environment (fedmvp, fedmvp-export, edge-client) as a user runs it.

    In process (the default) the command's click entry point runs with ``args`` in ``cwd`` and
    ``env``, exactly as the script would call it; an exception click did not turn into an exit
    code is printed as the traceback a user would see, so no row can hide one."""
    if not in_process or command not in ENTRY_POINTS:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        return subprocess.run([str(BIN / command), *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                              timeout=scaled(timeout))
    import importlib
    import traceback

    from click.testing import CliRunner

    module, name = ENTRY_POINTS[command]
    entry = getattr(importlib.import_module(module), name)
    previous = os.getcwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(entry, [str(a) for a in args], env=env, prog_name=command)
    finally:
        os.chdir(previous)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess([command, *args], result.exit_code, result.stdout, stderr)


def assert_one_line_error(done: subprocess.CompletedProcess, exit_code: int, fragment: str) -> None:
    """Exit code as promised, no traceback, and the message on one line of stderr (or --json stdout)."""
    output = done.stdout + done.stderr
    assert done.returncode == exit_code, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    lines = [line for line in output.splitlines() if fragment in line]
    assert lines, f"no line contains {fragment!r}:\n{output[-3000:]}"
