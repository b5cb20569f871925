"""The packages' imports flow one way and never in a circle (docs/architecture.md).

Read from the source with ``ast`` (nothing is imported), counting every import, also those inside
functions: a lazy import is still a dependency. Rules:
- ``edge_client`` imports neither ``fedmvp`` nor ``export`` (the device install has neither);
- ``fedmvp`` imports neither ``export`` nor ``edge_client``, except ``fedmvp.cli.demo``, the one
  command that drives the whole flow;
- ``node_app.client_app``, the ClientApp every SuperNode loads, is the one module that reaches both
  ``fedmvp`` (a site) and ``edge_client`` (an edge device), each lazily, inside its handler; no
  package imports ``node_app``;
- ``fedmvp_formats``, the shared leaf (formats and protocols), imports none of the others and only
  numpy, safetensors and the standard library besides; every package may import it;
- no two modules import each other, directly or through others.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fedmvp_formats", "fedmvp", "export", "edge_client", "node_app")
LEAF = "fedmvp_formats"
LEAF_THIRD_PARTY = {"numpy", "safetensors"}
ALLOWED_CROSSINGS = {"fedmvp.cli.demo": {"export", "edge_client"}, "node_app.client_app": {"fedmvp", "edge_client"}}
FORBIDDEN = {"edge_client": {"fedmvp", "export", "node_app"}, "fedmvp": {"export", "edge_client", "node_app"},
             "export": {"node_app"}, "node_app": {"fedmvp", "edge_client", "export"},
             LEAF: {"fedmvp", "export", "edge_client", "node_app"}}


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """module -> the project modules it imports (``from a import b`` is ``a.b`` when that is a module)."""
    files = {module_name(root, p): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def forbidden_imports(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        package = module.split(".")[0]
        allowed = ALLOWED_CROSSINGS.get(module, set())
        for target in sorted(targets):
            other = target.split(".")[0]
            if other in FORBIDDEN.get(package, set()) and other not in allowed:
                found.append(f"{module} imports {target}")
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(ROOT, PACKAGES)


def test_imports_flow_one_way(graph):
    assert forbidden_imports(graph) == []


def test_no_import_cycles(graph):
    assert cycles(graph) == []


def test_the_leaf_imports_only_numpy_safetensors_and_the_standard_library():
    """fedmvp_formats is in the smallest install (edge inference, no torch): nothing else may come in."""
    found = set()
    for path in (ROOT / LEAF).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                found.add((node.module or "").split(".")[0])
    assert found - set(sys.stdlib_module_names) - LEAF_THIRD_PARTY - {LEAF, "__future__"} == set()


def test_the_checker_sees_cycles_and_wrong_directions(tmp_path):
    """The rules above can fail: a tree with a cycle and an edge_client -> fedmvp import."""
    for rel, text in {"fedmvp/__init__.py": "", "fedmvp/a.py": "from fedmvp import b\n",
                      "fedmvp/b.py": "def f():\n    from fedmvp.a import x\n",
                      "edge_client/__init__.py": "", "edge_client/c.py": "import fedmvp.a\n",
                      "export/__init__.py": "", "export/d.py": "from . import e\n",
                      "export/e.py": "from .d import y\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    bad = import_graph(tmp_path, PACKAGES)
    assert forbidden_imports(bad) == ["edge_client.c imports fedmvp.a"]
    assert cycles(bad) == [["export.d", "export.e"], ["fedmvp.a", "fedmvp.b"]]


def test_the_dispatcher_imports_each_side_only_inside_its_handlers():
    """An edge node loads node_app.client_app without importing fedmvp (nor a site edge_client)."""
    tree = ast.parse((ROOT / "node_app" / "client_app.py").read_text(encoding="utf-8"))
    top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [alias.name for n in top_level for alias in n.names] + \
        [n.module or "" for n in top_level if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] in ("fedmvp", "edge_client", "export")]


def test_the_backbone_loader_needs_no_synthetic_world(graph):
    """`fedmvp.clip` loads every CLIP, the tiny one too; its tokenizer lives beside it, not in synthetic/."""
    assert sorted(t for t in graph["fedmvp.clip"] if t.startswith("fedmvp.synthetic")) == []
    assert "fedmvp.tiny_tokenizer" in graph["fedmvp.clip"]
