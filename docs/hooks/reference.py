"""mkdocs hook: the reference pages that are generated from the live code, never hand-copied, so they cannot drift from it.

A page holds a marker comment where a generated block goes (``<!-- generated: NAME -->``); this hook
replaces it with the block ``GENERATORS[NAME]`` builds at build time:

- ``preset-keys``: every preset table and key with its type, default and help, read from the preset
  schema's dataclasses (``fedmvp/presets/schema.py``, ``server.py``, the help in each field's metadata;
  the method keys' from ``fedmvp_formats/method.py``), so a new key appears without anyone writing it;
- ``bundle-manifest`` / ``update-file``: the two file formats, from the constants their one reader
  checks against (``fedmvp_formats/bundle_manifest.py``, ``fedmvp_formats/update.py``);
- ``python-api``: a mkdocstrings block per public name of each package's ``__init__`` (``__all__``).

The CLI reference needs no generator here: mkdocs-click renders the click groups themselves
(docs/reference/cli.md). Tests import this file by path (tests/docs/test_docs_site.py), and the
How-to section of the navigation lists every page under docs/howto/ (``on_config``), so a new
guide needs no edit of mkdocs.yml.
"""

from __future__ import annotations

import dataclasses
import html
import re
import types
import typing
from pathlib import Path
from typing import Any, Callable

MARKER = re.compile(r"<!-- generated: ([\w-]+) -->")
PACKAGES = ("fedmvp", "export", "edge_client", "fedmvp_formats")
HOWTO_SECTION = "How-to guides"


# ---- preset keys --------------------------------------------------------------------------------
def _default(f: dataclasses.Field) -> str:
    """The default as a TOML reader would write it; ``required`` when the key has none."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value}`"


def _table_class(hint: Any) -> tuple[type | None, bool]:
    """(the dataclass a field's type names, whether it is an array of tables) or (None, False)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _table_class(inner[0]) if len(inner) == 1 else (None, False)
    if typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]):
        return args[0], True
    return (hint, False) if dataclasses.is_dataclass(hint) else (None, False)


def _kind(hint: Any) -> str:
    """"an integer", "a number (optional)", "a list of strings": the schema's own wording."""
    from fedmvp.presets.fields import type_name

    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return f"{_kind(inner[0])} (optional)" if len(inner) == 1 else type_name(hint)
    if typing.get_origin(hint) is list:
        element = "list" if typing.get_origin(args[0]) is list else _kind(args[0]).split(" ", 1)[-1]
        return f"a list of {element}s"
    return type_name(hint)


def _plain(text: str) -> str:
    """Help or docstring text as Markdown shows it: ``<`` ``>`` ``&`` escaped outside `code` spans, so a
    placeholder such as runs/<name>/preset.toml is printed, not read as an HTML tag and dropped."""
    parts = text.split("`")
    return "`".join(html.escape(part, quote=False) if i % 2 == 0 else part for i, part in enumerate(parts))


def _rows(cls: type) -> list[str]:
    hints = typing.get_type_hints(cls)
    rows = ["| key | type | default | what it sets |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal") or _table_class(hints[f.name])[0] is not None:
            continue
        text = _plain(" ".join(str(f.metadata.get("help", "")).split())).replace("|", "\\|")
        kind = _kind(hints[f.name]).replace("|", "or")
        rows.append(f"| `{f.name}` | {kind} | {_default(f)} | {text} |")
    return rows


def preset_keys(preset: type | None = None) -> str:
    """Every table of a preset (the top level, then each table field of ``Preset``) and its keys."""
    if preset is None:
        from fedmvp.presets.schema import Preset as preset
    hints = typing.get_type_hints(preset)
    parts = ["### Top level", "", *_rows(preset), ""]
    for f in dataclasses.fields(preset):
        cls, array = _table_class(hints[f.name])
        if cls is None or f.metadata.get("internal"):
            continue
        title = f"[[{f.name}]]" if array else f"[{f.name}]"
        doc = _plain(" ".join((cls.__doc__ or "").split()))
        parts += [f"### `{title}`", "", doc, "", *_rows(cls), ""]
    return "\n".join(parts)


# ---- file formats -------------------------------------------------------------------------------
def bundle_manifest() -> str:
    from fedmvp_formats import bundle_manifest as bm

    kind = {dict: "object", str: "string", int: "integer", type(None): "null"}
    rows = [f"Format `{bm.FORMAT}`, version `{bm.FORMAT_VERSION}`: the file `{bm.MANIFEST}` at the top of the "
            "bundle directory. Its sections, as `check_manifest` holds every manifest to them:", "",
            "| section | type | required | what it holds |", "|---|---|---|---|"]
    for name, (kinds, required) in bm.SECTIONS.items():
        text = " ".join(bm.SECTION_HELP[name].split()).replace("|", "\\|")
        rows.append(f"| `{name}` | {' or '.join(kind.get(k, k.__name__) for k in kinds)} | "
                    f"{'yes' if required else 'no'} | {text} |")
    rows += ["", "The files a bundle holds, by role (`files_by_role`; required roles: "
             + ", ".join(f"`{r}`" for r in bm.REQUIRED_ROLES) + "):", "", "| role | file |", "|---|---|"]
    rows += [f"| `{role}` | `{name}` |" for role, name in bm.ROLES.items()]
    rows += ["", "Precisions (`precision`): " + ", ".join(f"`{p}`" for p in bm.PRECISIONS) + ". "
             f"`model.onnx` pins its class list in its metadata as `{bm.CLASSES_KEY}`. What a device adds "
             f"to the directory: `{bm.PERSONALISED}/` (its own LoRAs), `{bm.PREVIOUS}/` (what the last "
             f"refresh replaced) and, only while a refresh runs, `{bm.REFRESH_JOURNAL}`."]
    return "\n".join(rows)


def update_file() -> str:
    from fedmvp_formats import update as up

    def kind(name: str) -> str:
        return ("integer" if name in up.INT_FIELDS else "number" + (", finite" if name in up.FINITE_FIELDS else "")
                if name in up.FLOAT_FIELDS else "string")

    rows = [f"Format `{up.FORMAT}`, version `{up.FORMAT_VERSION}`: one safetensors file holding exactly a "
            "bundle's LoRA tensors (`lora.*`, float32) and string metadata (numbers as decimal strings, "
            "lists as JSON). The metadata, as its one reader checks it:", "",
            "| key | type | required | meaning |", "|---|---|---|---|"]
    for name, text in up.FIELDS.items():
        rows.append(f"| `{name}` | {kind(name)} | {'yes' if name in up.REQUIRED else 'no'} | "
                    f"{_plain(' '.join(text.split()))} |")
    rows += ["", f"Limits: a file without a bundle to size it by may hold at most {up.MAX_UPDATE_BYTES >> 20} MiB, "
             f"its header at most {up.MAX_HEADER_BYTES >> 20} MiB; unknown metadata keys are allowed (a newer "
             "writer's) and never echoed."]
    return "\n".join(rows)


# ---- install extras ---------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]
# What each extra is for; what it brings is read from pyproject.toml. An extra missing here fails the
# build, so a new one cannot go undocumented.
EXTRA_PURPOSE = {
    "": "inference on an edge device (the base install)",
    "cpu": "ONNX Runtime for the CPU (never with [gpu] in one environment)",
    "gpu": "ONNX Runtime with CUDA and TensorRT (never with [cpu])",
    "openvino": "OpenVINO as a second runtime (`edge-client infer --runtime openvino`, or `auto`)",
    "executorch": "ExecuTorch for phones (`fedmvp-export --format executorch`, `edge-client infer --runtime "
                  "executorch`; docs/howto/executorch.md)",
    "edge-train": "LoRA updates on the device (`edge-client train`)",
    "edge-join": "a device that joins the federation online (`edge-client join`)",
    "train": "federated training and export (`fedmvp`, `fedmvp-export`)",
    "dev": "the tests",
    "docs": "this site (`mkdocs serve`)",
}


def extras() -> str:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    groups = {"": project["dependencies"], **project["optional-dependencies"]}
    rows = ["| extra | for | brings |", "|---|---|---|"]
    for name, requirements in groups.items():
        if name not in EXTRA_PURPOSE:
            raise ValueError(f"pyproject.toml extra [{name}] has no line in docs/hooks/reference.py EXTRA_PURPOSE")
        brings = ", ".join(f"`{r}`" for r in requirements)
        rows.append(f"| {f'`[{name}]`' if name else '(none)'} | {EXTRA_PURPOSE[name]} | {brings} |")
    return "\n".join(rows)


# ---- Python API ---------------------------------------------------------------------------------
def public_names(package: str) -> dict[str, str]:
    """{public name: the module it lives in} from the package's lazy table (``__all__``), without
    importing the modules (torch stays unloaded)."""
    import importlib

    module = importlib.import_module(package)
    homes = getattr(module, "_HOMES", None)
    if homes is not None:
        return {name: homes[name] for name in module.__all__}
    return {name: getattr(module, name).__module__ for name in getattr(module, "__all__", [])}


def python_api() -> str:
    parts = []
    for package in PACKAGES:
        names = public_names(package)
        parts += [f"## `{package}`", "", f"::: {package}", "    options:", "      members: false",
                  "      show_root_heading: false", "      show_root_toc_entry: false", ""]
        for name, home in names.items():
            parts += [f"::: {home}.{name}", "    options:", "      heading_level: 3", ""]
    return "\n".join(parts)


GENERATORS: dict[str, Callable[[], str]] = {
    "preset-keys": preset_keys, "bundle-manifest": bundle_manifest, "update-file": update_file,
    "python-api": python_api, "extras": extras,
}


def expand(markdown: str) -> str:
    """``markdown`` with every marker replaced by its generated block (an unknown name fails the build)."""
    def block(match: re.Match) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise ValueError(f"unknown generated block {name!r} (known: {', '.join(GENERATORS)})")
        return GENERATORS[name]()

    return MARKER.sub(block, markdown)


# ---- mkdocs events ------------------------------------------------------------------------------
def on_config(config: Any) -> Any:
    """Every docs/howto/*.md page is in the How-to section, listed pages first in their order."""
    howto = Path(config["docs_dir"]) / "howto"
    for entry in config["nav"] or []:
        if isinstance(entry, dict) and HOWTO_SECTION in entry:
            listed = {next(iter(e.values())) if isinstance(e, dict) else e for e in entry[HOWTO_SECTION]}
            entry[HOWTO_SECTION] += [f"howto/{p.name}" for p in sorted(howto.glob("*.md"))
                                     if f"howto/{p.name}" not in listed]
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return expand(markdown)
