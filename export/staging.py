"""Where an export is written before it is published, and what a killed export left behind.

An export writes its bundle into ``OUT.tmp-<pid>-<random>`` beside ``OUT`` and renames it onto ``OUT``
once complete (``export.publish``); an export that fails or is stopped removes it. One killed outright
(SIGKILL, a power cut) cannot, so the next export of the same ``OUT`` removes every staging folder
whose export is gone: no process of that pid runs on this machine, or the one that does started after
the folder was made (the pid was reused). A folder whose export may still run is left alone, and so is
one of an older fedmvp (``OUT.tmp-<random>``: no pid to check). Linux (``/proc``); elsewhere nothing is
removed.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path


def staging_dir(out: Path) -> Path:
    """A new private folder beside ``out`` for this process's export of it."""
    return Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-{os.getpid()}-", dir=out.parent))


def _started(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch); None: no such process, or no ``/proc``."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time in clock ticks after boot


def stale_staging(out: Path) -> list[tuple[Path, int]]:
    """Staging folders of ``out`` whose export is gone, with the pid that made each."""
    if not Path("/proc/stat").exists() or not out.parent.is_dir():
        return []
    pattern = re.compile(re.escape(out.name) + r"\.tmp-(\d+)-[A-Za-z0-9_]+")
    found = []
    for entry in out.parent.iterdir():
        match = pattern.fullmatch(entry.name)
        if match is None or entry.is_symlink() or not entry.is_dir():
            continue
        pid = int(match.group(1))
        started = _started(pid)
        if pid != os.getpid() and (started is None or started > entry.stat().st_mtime + 1.0):
            found.append((entry, pid))
    return sorted(found)


def clean_stale_staging(out: Path) -> list[str]:
    """Remove what `stale_staging` finds; one line per folder removed."""
    lines = []
    for folder, pid in stale_staging(out):
        shutil.rmtree(folder, ignore_errors=True)
        lines.append(f"removed {folder}: the staging folder of an export (pid {pid}) that was killed before it "
                     f"finished")
    return lines
