"""`fedmvp attributes`: write and check the per-class attribute files the text classifier is built from.

Exit codes: 0 ok; 1 some classes failed or a checked file has problems (answers already
written stay on disk); 2 bad input or usage (nothing was asked).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from fedmvp_apps.cli.common import FiniteFloat
from fedmvp.attributes.files import (META_KEY, AttributeFileError, read_attribute_file,
                                     read_class_names)
from fedmvp.attributes.prompt import listed, shown


class BadInput(click.ClickException):
    """A one-line error about the input, exiting 2 like click's own usage errors."""

    exit_code = 2


class _EchoHandler(logging.Handler):
    """Log lines to the current stderr (resolved per line, so test runners capture them)."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"{record.levelname.lower()}: {self.format(record)}", err=True)


def _class_names(classes: Path | None, preset: str | None) -> list[str]:
    if (classes is None) == (preset is None):
        raise BadInput("give exactly one of --classes FILE or --preset NAME")
    if classes is not None:
        try:
            return read_class_names(classes)
        except AttributeFileError as exc:
            raise BadInput(str(exc)) from None
    from fedmvp.data.catalog import preset_class_names

    try:
        names = preset_class_names(preset)
    except (KeyError, ValueError, OSError) as exc:
        raise BadInput(f"preset {preset!r}: {exc}") from None
    if not names:
        raise BadInput(f"preset {preset!r} has no class names")
    return names


def _check_domain(preset: str | None, domain: str | None) -> None:
    """With a preset that lists domains, the hint must be one of them (catches typos early)."""
    if not (preset and domain):
        return
    from fedmvp.data.catalog import preset_domains

    try:
        domains = preset_domains(preset)
    except (KeyError, ValueError, OSError) as exc:
        raise BadInput(f"preset {preset!r}: {exc}") from None
    if domains and domain not in domains:
        raise BadInput(f"preset {preset!r} has no domain {domain!r}; "
                       f"its domains are: {', '.join(domains)}")


def _default_out(classes: Path | None, preset: str | None, domain: str | None) -> Path:
    stem = Path(preset).stem if preset else Path(classes).stem  # type: ignore[arg-type]
    return Path("attributes") / f"{stem}{f'_{domain}' if domain else ''}.json"


@click.group("attributes")
def attributes() -> None:
    """LLM-written visual attribute phrases per class: {class: [K phrases]} JSON files.

    `generate` asks an OpenAI-compatible server (OpenAI, vLLM, Ollama, a proxy) for the
    phrases; `check` validates a file you already have, such as the paper's. Loaders
    accept both and ignore the "_meta" block generated files carry.
    """


@attributes.command("generate")
@click.option("--classes", "classes", type=click.Path(path_type=Path, dir_okay=False),
              help="Class list: one name per line (# comments, blank lines skipped) or a JSON list.")
@click.option("--preset", help="Take the class names from a preset (name or TOML path).")
@click.option("--out", "out", type=click.Path(path_type=Path, dir_okay=False),
              help="Output JSON. Default: attributes/<preset or list name>[_<domain>].json. "
                   "Classes already in it are kept; only missing ones are asked for.")
@click.option("--model", default="gpt-4o", show_default=True, help="Chat model to ask.")
@click.option("--k", "k", default=10, show_default=True, type=click.IntRange(1, 50),
              help="Phrases per class.")
@click.option("--domain", help='Domain hint for the prompt, e.g. "sketch" (one file per domain).')
@click.option("--base-url", envvar="OPENAI_BASE_URL",
              help="OpenAI-compatible server, e.g. http://localhost:8000/v1 [env OPENAI_BASE_URL]. "
                   "The API key is read from OPENAI_API_KEY only.")
@click.option("--offline", is_flag=True,
              help="Ask nobody: write template phrases built from the class names, marked as "
                   "such in the metadata, so training can run; a later online run replaces them.")
@click.option("--concurrency", default=4, show_default=True, type=click.IntRange(1, 64),
              help="Classes asked in parallel.")
@click.option("--max-retries", default=5, show_default=True, type=click.IntRange(0, 20),
              help="Retries per request on 429, 5xx, timeouts and dropped connections.")
@click.option("--backoff", default=1.0, show_default=True, type=FiniteFloat(0),
              help="Base delay in seconds of the exponential backoff (Retry-After wins).")
@click.option("--timeout", default=60.0, show_default=True, type=FiniteFloat(0.1),
              help="Seconds one request may take in all, connecting to last byte (a wall-clock "
                   "deadline: a server trickling bytes cannot stretch it).")
@click.option("--temperature", type=FiniteFloat(0, 2),
              help="Sampling temperature (default: the server's).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="Progress bar on stderr (only on a terminal).")
@click.option("-v", "--verbose", is_flag=True, help="Also log what is being asked.")
def generate(classes: Path | None, preset: str | None, out: Path | None, model: str, k: int,
             domain: str | None, base_url: str | None, offline: bool, concurrency: int,
             max_retries: int, backoff: float, timeout: float, temperature: float | None,
             as_json: bool, progress: bool, verbose: bool) -> None:
    """Write K visual attribute phrases per class with an LLM (structured JSON output).

    Every answer is checked (exactly K distinct, non-empty, short phrases) and re-asked
    if wrong. The file is rewritten atomically after each class, so an interrupted or
    failed run keeps what it has and a rerun asks only for the rest.

    \b
    Examples:
      OPENAI_API_KEY=... fedmvp attributes generate --preset pacs --domain sketch
      fedmvp attributes generate --classes classes.txt --base-url http://localhost:11434/v1 --model llama3.1
      fedmvp attributes generate --classes classes.txt --offline
    """
    from fedmvp.attributes.generate import GenerateConfig, GenerateError, generate_attributes

    names = _class_names(classes, preset)
    _check_domain(preset, domain)
    out = out or _default_out(classes, preset, domain)
    config = GenerateConfig(model=model, k=k, domain=domain, concurrency=concurrency,
                            max_retries=max_retries, backoff_base=backoff, timeout=timeout,
                            temperature=temperature)
    logger = logging.getLogger("fedmvp.attributes")
    handler = _EchoHandler()
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    try:
        report = generate_attributes(names, out, config, offline=offline, base_url=base_url,
                                     progress=progress)
    except GenerateError as exc:
        raise BadInput(str(exc)) from None
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        what = "template (offline)" if offline else f"{model}"
        click.echo(f"{out}: {len(report.generated)} classes written by {what}, "
                   f"{len(report.kept)} kept, {len(report.failed)} failed, "
                   f"{len(report.skipped)} not asked")
    for name, reason in report.failed.items():
        if reason != report.aborted:
            click.echo(f"error: {shown(name)}: {reason}", err=True)
    if not report.ok:
        click.echo(f"error: {out}: answers so far are saved; rerun to ask for the "
                   f"{len(report.failed) + len(report.skipped)} missing ones", err=True)
        sys.exit(1)


@attributes.command("check")
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--classes", "classes", type=click.Path(path_type=Path, dir_okay=False),
              help="Class list the file must cover (default: the classes it has).")
@click.option("--preset", help="Take the class names the file must cover from a preset.")
@click.option("--k", "k", default=10, show_default=True, type=click.IntRange(1, 50),
              help="Phrases each class needs (extra ones are ignored by loaders).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report on stdout.")
def check(file: Path, classes: Path | None, preset: str | None, k: int, as_json: bool) -> None:
    """Validate an attribute FILE: readable, covers the classes, K usable phrases each.

    Paper-style files without metadata are fine. Exits 1 listing every problem at once.
    """
    from fedmvp.attributes.prompt import phrase_problems

    try:
        attrs, meta = read_attribute_file(file)
    except AttributeFileError as exc:
        raise BadInput(str(exc)) from None
    names = list(attrs) if classes is None and preset is None else _class_names(classes, preset)
    missing = [c for c in names if c not in attrs]
    problems: dict[str, list[str]] = {}
    for name in (c for c in names if c in attrs):
        found = phrase_problems(attrs[name], None)
        if len(attrs[name]) < k:
            found.insert(0, f"{len(attrs[name])} phrases, need {k}")
        if found:
            problems[name] = found
    offline = [c for c in meta.get("offline_classes", []) if c in attrs]
    ok = not missing and not problems
    if as_json:
        click.echo(json.dumps({"file": str(file), "ok": ok, "classes": len(names),
                               "missing": missing, "problems": problems,
                               "offline_classes": offline, META_KEY: meta}, indent=2))
    else:
        source = (", ".join(shown(str(meta[key])) for key in ("model", "prompt_version", "updated")
                            if meta.get(key)) or "metadata without a model (offline templates)"
                  if meta else "no metadata (plain {class: [phrases]} file)")
        click.echo(f"{file}: {len(names)} classes, {source}")
        if offline:
            click.echo(f"note: {len(offline)} classes hold offline template phrases", err=True)
        if missing:
            click.echo(f"error: {len(missing)} classes missing: {listed(missing)}", err=True)
        for name, found in problems.items():
            click.echo(f"error: {shown(name)}: {'; '.join(found[:5])}", err=True)
        if ok:
            click.echo("ok")
    if not ok:
        sys.exit(1)
