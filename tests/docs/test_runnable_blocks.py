"""Every code block a tutorial marks as runnable runs, in order, in a fresh folder (issue 27).

The one-machine tutorial is written to run on the shipped tiny CLIP in a minute or two: this is the
check that a newcomer's copy-paste works with the code as it is now."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deadlines import scaled
from tests.docs.runnable import DOCS, pages_with_blocks, runnable_blocks
from tests.process_markers import is_deployment

ROOT = DOCS.parent


def page_param(page: Path):
    """A page whose blocks start a federation (`fedmvp train`: a Ray simulation) is a `deployment` test."""
    federates = any(is_deployment(line) for block in runnable_blocks(page) if not block.file
                    for line in block.body.splitlines())
    return pytest.param(page, id=page.relative_to(DOCS).as_posix(),
                        marks=[pytest.mark.deployment] if federates else [])


def test_the_one_machine_tutorial_has_runnable_blocks():
    assert "tutorials/one-machine.md" in [p.relative_to(DOCS).as_posix() for p in pages_with_blocks()]


@pytest.mark.processes
@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", [page_param(page) for page in pages_with_blocks()])
def test_runnable_blocks_run(page: Path, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    for i, block in enumerate(runnable_blocks(page)):
        if block.file:
            (tmp_path / block.file).write_text(block.body + "\n", encoding="utf-8")
            continue
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.body], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=scaled(600))
        shown = (done.stdout + done.stderr)[-3000:]
        assert done.returncode == 0, f"{block.page} block {i}:\n{block.body}\n---\n{shown}"
