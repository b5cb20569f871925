"""docs/architecture.md and the docs site's layout (docs/index.md) name every module of the tree (they must not drift)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fedmvp_formats", "fedmvp", "export", "edge_client", "node_app", "fedmvp_apps")


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end >= 0 else None]


def _modules(depth_one_only: bool) -> set[str]:
    """Module file names (and sub-package folders as 'name/'); ``fedmvp_apps/cli`` is described as a whole."""
    names: set[str] = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT / package)
            if path.name in ("__init__.py", "__main__.py") or rel.parts[0] == "cli":
                continue
            if len(rel.parts) > 1:
                names.add(f"{rel.parts[0]}/")
                if depth_one_only:
                    continue
            names.add(path.name)
    return names


def _mentioned(text: str) -> set[str]:
    """File names as written ("layouts.py") and sub-packages ("data/")."""
    return set(re.findall(r"\w+\.py|\w+/", text))


def test_architecture_doc_names_every_module():
    text = _section((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"), "## Where things live")
    assert sorted(_modules(depth_one_only=False) - _mentioned(text)) == []


def test_docs_home_layout_names_every_top_level_module():
    text = _section((ROOT / "docs" / "index.md").read_text(encoding="utf-8"), "## Layout")
    assert sorted(_modules(depth_one_only=True) - _mentioned(text)) == []
