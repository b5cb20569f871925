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


# ---- citations a reader can follow ------------------------------------------------------------------

CODE = (*PACKAGES, "benchmarks")
ISSUE_CITATION = re.compile(r"\b[Ii]ssues? \d+")  # "issue 24 §5": a tracker number means nothing to a reader
# "docs/architecture.md, "Runtimes"", "architecture.md "Layers"", "architecture.md, Migrations", "architecture.md#layers"
SECTION_REF = re.compile(r"architecture\.md(?:#([\w-]+)|,?\s*\"([^\"]+)\"|,\s+([A-Za-z][\w -]*\w))")


def _text_files(folders: tuple[str, ...], suffixes: tuple[str, ...]) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*") if p.suffix in suffixes and p.is_file())


def _slug(heading: str) -> str:
    """mkdocs' anchor of a heading (toc's slugify: lower case, punctuation dropped, spaces to hyphens)."""
    return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower())


def _headings(path: Path) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#+\s+(.+)$", path.read_text(encoding="utf-8"), re.M)}


def test_no_code_or_doc_cites_an_issue_number():
    """Comments, docstrings, help texts and docs give the reason in the code's own terms, or a docs/ page."""
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
             for p in _text_files(CODE, (".py",)) + _text_files(("docs",), (".md", ".py", ".yml"))
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if ISSUE_CITATION.search(line)]
    assert found == []


def test_every_architecture_section_cited_exists():
    """A section of docs/architecture.md named in code or docs ("Layers", #layers) is a heading there."""
    headings = _headings(ROOT / "docs" / "architecture.md")
    names, slugs = {h.lower() for h in headings}, {_slug(h) for h in headings}
    missing = []
    for path in _text_files((*CODE, "tests"), (".py",)) + _text_files(("docs",), (".md",)):
        if path == Path(__file__).resolve():  # this file's patterns are no references
            continue
        # a reference may wrap: join the lines, dropping comment markers and indentation
        text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text(encoding="utf-8"))
        for anchor, quoted, bare in SECTION_REF.findall(text):
            if anchor and anchor not in slugs:
                missing.append(f"{path.relative_to(ROOT)}: #{anchor}")
            elif quoted and quoted.lower() not in names:
                missing.append(f"{path.relative_to(ROOT)}: \"{quoted}\"")
            elif bare and not any(bare.lower().startswith(name) for name in names):
                missing.append(f"{path.relative_to(ROOT)}: {bare}")
    assert missing == []


def test_the_section_reference_reader_finds_what_it_checks():
    """The reader of the test above sees each way a section is cited (else it would pass on nothing)."""
    sample = ('docs/architecture.md "Layers") architecture.md, "int8" architecture.md#across-machines '
              "docs/architecture.md, Migrations).")
    assert SECTION_REF.findall(sample) == [("", "Layers", ""), ("", "int8", ""), ("across-machines", "", ""),
                                           ("", "", "Migrations")]
