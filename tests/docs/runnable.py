"""The code blocks a docs page marks as runnable, in page order (issue 27: tutorials that run).

A fence right after ``<!-- runnable -->`` is a bash script; one after ``<!-- runnable: NAME -->`` is
the text of the file NAME, written before the next script runs. A page's blocks share one folder.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
_BLOCK = re.compile(r"<!-- runnable(?::\s*(?P<file>[\w.-]+))? -->\s*\n```(?P<lang>\w*)\n(?P<body>.*?)\n```", re.S)


@dataclass(frozen=True)
class Block:
    page: str
    file: str | None  # None: a bash script
    body: str


def runnable_blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    return [Block(page.relative_to(DOCS).as_posix(), m.group("file"), m.group("body")) for m in _BLOCK.finditer(text)]


def pages_with_blocks() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if runnable_blocks(p))
