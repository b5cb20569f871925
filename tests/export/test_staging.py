"""Which staging folders the next export removes (export/staging.py): only those whose export is gone."""

from __future__ import annotations

import os
from pathlib import Path

from export.staging import clean_stale_staging, stale_staging, staging_dir


def _gone_pid() -> int:
    """A pid no process has now."""
    pid = 4_000_000
    while Path(f"/proc/{pid}").exists():
        pid -= 1
    return pid


def test_only_the_folders_of_gone_exports_are_removed(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    mine = staging_dir(out)  # this process's own export: running
    assert mine.name.startswith(f"bundle.tmp-{os.getpid()}-")
    gone = tmp_path / f"bundle.tmp-{_gone_pid()}-abc123"
    early = tmp_path / "bundle.tmp-1-zz9"  # pid 1, started at boot: before the folder, so maybe its export
    older = tmp_path / "bundle.tmp-abcdef"  # an older fedmvp's: no pid to check
    other = tmp_path / f"other.tmp-{_gone_pid()}-abc"  # another OUT's
    for folder in (gone, early, older, other):
        folder.mkdir()
    (tmp_path / f"bundle.tmp-{_gone_pid()}-link").symlink_to(tmp_path / "elsewhere")
    # pid 1 started before the folder was made: it may be the export that made it, so it stays
    assert [folder for folder, _ in stale_staging(out)] == [gone]
    lines = clean_stale_staging(out)
    assert lines == [f"removed {gone}: the staging folder of an export (pid {gone.name.split('-')[1]}) that was "
                     f"killed before it finished"]
    assert not gone.exists() and mine.exists() and early.exists() and older.exists() and other.exists()


def test_a_reused_pid_does_not_keep_a_folder(tmp_path: Path) -> None:
    """A process of that pid that started after the folder was made is not its export."""
    out = tmp_path / "bundle"
    folder = tmp_path / f"bundle.tmp-{os.getppid()}-abc"
    folder.mkdir()
    os.utime(folder, (0, 0))  # made before any process now running started
    assert [f for f, _ in stale_staging(out)] == [folder]
