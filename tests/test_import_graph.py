"""The packages' imports flow down the layers and never in a circle (docs/architecture.md "Layers").

Read from the source with ``ast`` (nothing is imported), counting every import, also those inside
functions: a lazy import is still a dependency. Four layers, no exceptions:
- the leaf, ``fedmvp_formats`` (formats and protocols), imports no project package and only numpy,
  safetensors and the standard library besides;
- the core libraries ``fedmvp`` and ``edge_client`` import the leaf and no other library (a site has
  no edge client, a device no training core);
- the exporter, ``export``, imports the leaf, ``fedmvp`` (to rebuild the model) and ``edge_client``
  (the bundle format);
- the apps, ``fedmvp_apps`` (every command, serve and both joins) and ``node_app`` (the ClientApp
  every SuperNode loads), import any package below them; no library imports an app, and neither
  app package imports the other;
- no two modules import each other, directly or through others.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LEAF = "fedmvp_formats"
LIBRARIES = ("fedmvp", "export", "edge_client")
APPS = ("fedmvp_apps", "node_app")
PACKAGES = (LEAF, *LIBRARIES, *APPS)
LEAF_THIRD_PARTY = {"numpy", "safetensors"}
# What each package may import besides itself: the layers below, and inside the library layer only
# export's two edges. Nothing else, for any module.
MAY_IMPORT = {LEAF: set(), "fedmvp": {LEAF}, "edge_client": {LEAF}, "export": {LEAF, "fedmvp", "edge_client"},
              **{app: {LEAF, *LIBRARIES} for app in APPS}}
# The device's commands (`edge-client`, its `join` included): installed without open_clip or the
# training core, so what they reach is edge_client, the leaf, click and the standard library; torch
# only inside the functions that train (fedmvp[edge-train], fedmvp[edge-join]).
EDGE_APPS = ("fedmvp_apps.edge_cli", "fedmvp_apps.edge_join")
EDGE_APP_THIRD_PARTY = {"click"}
EDGE_APP_LAZY_THIRD_PARTY = {"torch"}


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
        for target in sorted(targets):
            other = target.split(".")[0]
            if other != package and other not in MAY_IMPORT[package]:
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


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every project module ``start`` imports, directly or through others (lazy imports too)."""
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def third_party_imports(path: Path, top_level_only: bool = False) -> set[str]:
    """Top-level names of the absolute imports of one file that are not the standard library's
    (``top_level_only``: those the module runs when it is imported, not those inside functions)."""
    found = set()
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in (tree.body if top_level_only else ast.walk(tree)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add((node.module or "").split(".")[0])
    return found - set(sys.stdlib_module_names) - {"__future__"}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(ROOT, PACKAGES)


def test_imports_flow_one_way(graph):
    assert forbidden_imports(graph) == []


def test_no_import_cycles(graph):
    assert cycles(graph) == []


def test_the_leaf_imports_only_numpy_safetensors_and_the_standard_library():
    """fedmvp_formats is in the smallest install (edge inference, no torch): nothing else may come in."""
    found = set().union(*(third_party_imports(path) for path in (ROOT / LEAF).rglob("*.py")))
    assert found - LEAF_THIRD_PARTY - {LEAF} == set()


def test_the_checker_sees_cycles_and_wrong_directions(tmp_path):
    """The rules above can fail: a cycle, an edge_client -> fedmvp import, and libraries that import
    an app (a lazy one too); an app importing a library is fine."""
    for rel, text in {"fedmvp/__init__.py": "", "fedmvp/a.py": "from fedmvp import b\n",
                      "fedmvp/b.py": "def f():\n    from fedmvp.a import x\n",
                      "fedmvp/c.py": "def f():\n    from fedmvp_apps.cli import main\n",
                      "edge_client/__init__.py": "", "edge_client/c.py": "import fedmvp.a\n",
                      "edge_client/d.py": "from node_app import client_app\n",
                      "export/__init__.py": "", "export/d.py": "from . import e\n",
                      "export/e.py": "from .d import y\n",
                      "fedmvp_apps/__init__.py": "",
                      "fedmvp_apps/cli.py": "from export.d import y\nimport fedmvp.a\n",
                      "node_app/__init__.py": "", "node_app/client_app.py": "import fedmvp_apps.cli\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    bad = import_graph(tmp_path, PACKAGES)
    assert forbidden_imports(bad) == ["edge_client.c imports fedmvp.a", "edge_client.d imports node_app.client_app",
                                      "fedmvp.c imports fedmvp_apps.cli",
                                      "node_app.client_app imports fedmvp_apps.cli"]
    assert cycles(bad) == [["export.d", "export.e"], ["fedmvp.a", "fedmvp.b"]]


def test_the_edge_commands_reach_only_the_edge_client_and_the_leaf(graph):
    """`edge-client` and `edge-client join` (the one SuperNode launch included) on a device install:
    no fedmvp, no export, and besides the project only click."""
    for start in EDGE_APPS:
        modules = reachable(graph, start) | {start}
        assert sorted(m for m in modules if m.split(".")[0] not in ("edge_client", LEAF, "fedmvp_apps")) == []
        apps = [m for m in modules if m.startswith("fedmvp_apps")]
        for module in apps:
            path = ROOT / (module.replace(".", "/") + ".py")
            at_import = third_party_imports(path, top_level_only=True) - set(PACKAGES)
            assert at_import - EDGE_APP_THIRD_PARTY == set(), module
            lazily = third_party_imports(path) - set(PACKAGES)
            assert lazily - EDGE_APP_THIRD_PARTY - EDGE_APP_LAZY_THIRD_PARTY == set(), module


def test_both_joins_share_one_supernode_launch(graph):
    """`fedmvp join` and `edge-client join` start Flower's SuperNode through one module."""
    assert "fedmvp_apps.deploy.supernode" in graph["fedmvp_apps.cli.join"]
    assert "fedmvp_apps.deploy.supernode" in graph["fedmvp_apps.edge_join"]


def test_the_app_package_init_imports_nothing():
    """`edge-client` imports ``fedmvp_apps`` on a device: its ``__init__`` must cost nothing."""
    tree = ast.parse((ROOT / "fedmvp_apps" / "__init__.py").read_text(encoding="utf-8"))
    assert [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))] == []


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


def test_local_training_reaches_no_flower(graph):
    """`local_train` runs where flwr is absent (the benchmarks on a lent GPU machine found it importing
    the strategy for one seed helper): nothing it reaches imports flwr."""
    modules = reachable(graph, "fedmvp.federated.task") | {"fedmvp.federated.task"}
    flower = [m for m in modules if "flwr" in third_party_imports(ROOT / (m.replace(".", "/") + ".py"))]
    assert flower == []
