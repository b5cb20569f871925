"""Run a console script with one function made to stop once: a test's deterministic overlap.

    python paused.py GATE MODULE:ATTR[.ATTR][@N] COMMAND ARGS...

The first (or the N-th) call of MODULE.ATTR writes this pid to GATE.reached, waits until the file
GATE exists, then runs as usual; COMMAND (fedmvp, fedmvp-export, edge-client) then runs exactly as its console
script would. The command's own code is unchanged: the pause is a test's, not a hook in the product.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path

ENTRY_POINTS = {"fedmvp": "fedmvp_apps.cli", "fedmvp-export": "fedmvp_apps.export_cli",
                "edge-client": "fedmvp_apps.edge_cli"}


def pause_once(owner: object, name: str, gate: Path, at_call: int = 1) -> None:
    """Replace ``owner.name`` by a version that stops at its ``at_call``-th call until ``gate`` exists."""
    original = getattr(owner, name)
    calls = []

    def paused(*args, **kwargs):
        calls.append(1)
        if len(calls) == at_call:
            Path(f"{gate}.reached").write_text(str(os.getpid()))
            while not gate.exists():
                time.sleep(0.05)
        return original(*args, **kwargs)

    setattr(owner, name, paused)


def main() -> None:
    gate, target, command, *args = sys.argv[1:]
    target, _, at_call = target.partition("@")
    module, _, path = target.partition(":")
    owner = importlib.import_module(module)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    pause_once(owner, name, Path(gate), int(at_call or 1))
    sys.argv = [command, *args]
    importlib.import_module(ENTRY_POINTS[command]).main()


if __name__ == "__main__":
    main()
