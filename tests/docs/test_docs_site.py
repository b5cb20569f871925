"""The docs site builds with `mkdocs build --strict`, and its reference pages hold every flag, preset key,
format field and public name of the live code (issue 27: nothing documented by hand, nothing missing).

One build per module (about 10 s); the generators are also called directly with a fake key, to show
that a key added to the schema appears without anyone writing it."""

from __future__ import annotations

import dataclasses
import html
import importlib.util
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import click
import pytest
from tests.deadlines import scaled

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("mkdocs", reason="the [docs] extra is not installed")


def _hook():
    spec = importlib.util.spec_from_file_location("docs_reference_hook", ROOT / "docs" / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(300))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return out


def _text(site: Path, page: str) -> str:
    """The page's visible text (tags dropped, entities decoded)."""
    return html.unescape(re.sub(r"<[^>]+>", " ", (site / page / "index.html").read_text(encoding="utf-8")))


def _commands(command: click.Command, path: str):
    """(path, command) for a command and every subcommand (lazy ones imported)."""
    yield path, command
    if isinstance(command, click.Group):
        ctx = click.Context(command)
        for name in command.list_commands(ctx):
            yield from _commands(command.get_command(ctx, name), f"{path} {name}")


def _spec_classes():
    from fedmvp.presets.schema import Preset

    hook = _hook()
    hints = typing.get_type_hints(Preset)
    yield Preset
    for f in dataclasses.fields(Preset):
        cls, _ = hook._table_class(hints[f.name])
        if cls is not None:
            yield cls


@pytest.mark.processes  # the module's one `mkdocs build` (fixture site)
def test_strict_build_passes_and_every_page_of_the_nav_exists(site):
    for page in ("tutorials/one-machine", "howto/ingest", "reference/cli", "reference/presets", "method",
                 "architecture"):
        assert (site / page / "index.html").is_file(), page


@pytest.mark.processes  # the module's one `mkdocs build` (fixture site)
def test_cli_reference_has_every_command_and_flag(site):
    from fedmvp_apps import cli, edge_cli, export_cli

    text = _text(site, "reference/cli")
    missing = []
    for prog, group in (("fedmvp", cli.main), ("fedmvp-export", export_cli.main), ("edge-client", edge_cli.main)):
        for path, command in _commands(group, prog):
            if path not in text:
                missing.append(path)
            for param in command.params:
                missing += [f"{path} {opt}" for opt in param.opts if opt.startswith("-") and opt not in text]
    assert missing == []


@pytest.mark.processes  # the module's one `mkdocs build` (fixture site)
def test_preset_reference_has_every_key_of_every_table(site):
    hook = _hook()
    text = _text(site, "reference/presets")
    missing = []
    for cls in _spec_classes():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            table, array = hook._table_class(hints[f.name])
            name = (f"[[{f.name}]]" if array else f"[{f.name}]") if table else f" {f.name} "
            if not f.metadata.get("internal") and name not in text:
                missing.append(f"{cls.__name__}.{f.name}")
    assert missing == []


def test_a_key_added_to_the_schema_appears_with_its_type_default_and_help():
    from fedmvp.presets.fields import spec_field
    from fedmvp.presets.schema import Preset, TrainSpec

    fake_train = dataclasses.make_dataclass(
        "FakeTrain", [("warmup_rounds", int, spec_field("rounds of linear warm-up before the cosine decay", 3))],
        bases=(TrainSpec,))
    fake_preset = dataclasses.make_dataclass("FakePreset", [("train", fake_train, spec_field("[train] table", None))],
                                             bases=(Preset,))
    markdown = _hook().preset_keys(fake_preset)
    assert "| `warmup_rounds` | an integer | `3` | rounds of linear warm-up before the cosine decay |" in markdown
    assert "| `lr` | a number | `0.003` |" in markdown  # the inherited keys stay


def test_a_placeholder_in_a_help_text_is_printed_not_read_as_html():
    """runs/<name>/preset.toml in a help text reaches the rendered page whole (an unescaped <name> is an
    HTML tag the browser drops: "runs//preset.toml")."""
    import markdown

    rendered = markdown.markdown(_hook().preset_keys(), extensions=["tables"])
    text = html.unescape(re.sub(r"<[^>]+>", " ", rendered))
    assert "runs/<name>/preset.toml" in text and "runs//preset.toml" not in text
    assert "DIR/<class>/<image>" in text


@pytest.mark.processes  # the module's one `mkdocs build` (fixture site)
def test_format_references_name_every_section_and_metadata_key(site):
    from fedmvp_formats import bundle_manifest, update

    bundle = _text(site, "reference/bundle")
    assert [k for k in bundle_manifest.SECTIONS if f" {k} " not in bundle] == []
    assert [f for f in bundle_manifest.ROLES.values() if f not in bundle] == []
    update_text = _text(site, "reference/update-file")
    assert [k for k in update.FIELDS if f" {k} " not in update_text] == []
    # every key the format checks has a meaning
    assert set(update.REQUIRED) | set(update.INT_FIELDS) | set(update.FLOAT_FIELDS) <= set(update.FIELDS)


def test_the_update_files_a_device_writes_use_only_documented_keys(tmp_path):
    import numpy as np
    from safetensors import safe_open

    from fedmvp_formats import update

    data = update.update_bytes({"lora.x.lora_A.weight": np.zeros((2, 2), np.float32)},
                               {"bundle_id": "0" * 64, "bundle_round": 1, "num_examples": 3, "mean_loss": 0.5,
                                "created": update.utc_now()})
    (tmp_path / "u.safetensors").write_bytes(data)
    with safe_open(str(tmp_path / "u.safetensors"), "np") as f:
        assert set(f.metadata()) <= set(update.FIELDS)
    from edge_client import lora_store

    assert set(lora_store._UPDATE_KEYS) <= set(update.FIELDS)


@pytest.mark.processes  # the module's one `mkdocs build` (fixture site)
def test_api_reference_renders_every_public_name(site):
    hook = _hook()
    text = _text(site, "reference/api")
    missing = [f"{package}.{name}" for package in hook.PACKAGES for name in hook.public_names(package)
               if name not in text]
    assert missing == []


def test_readme_stays_a_front_door_and_quotes_the_demo_as_the_tutorial_does():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 150
    assert "<!-- test-command -->" in readme and "<!-- demo-command -->" in readme
    demo_block = readme.split("## What the demo prints", 1)[1].split("```\n", 2)[1]
    tutorial = (ROOT / "docs" / "tutorials" / "demo.md").read_text(encoding="utf-8")
    assert demo_block.strip() in tutorial  # one output, quoted twice: the README's figures are the demo's
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert [link for link in links if "://" not in link and not (ROOT / link).exists()] == []
