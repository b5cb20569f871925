"""``python -m benchmarks``: every measurement of the project, side by side, with its goals.

    python -m benchmarks                          # all sections, full size (ViT-B-16 where it matters)
    python -m benchmarks --quick                  # smoke test on the tiny model (what CI may run)
    python -m benchmarks --only edge,comm --out bench/
    python -m benchmarks edge --model ViT-B-16 --json
    python -m benchmarks sizes --vit-b16          # one of the single-purpose scripts (see `--help`)

Writes ``results.json``, ``results.md`` and PNG plots into ``--out`` (default
``benchmarks/results/<time>``) and prints the machine and which goals are met. Goals are
reported, never asserted: exit code 0 whatever they say, 1 when a section failed, 2 bad usage.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
import traceback
from pathlib import Path

import click

from benchmarks.common import REPO, Options, Section, set_threads

# section name -> module (each has run(Options) -> Section and main(argv))
SECTIONS = {
    "edge": "benchmarks.edge",
    "prompts": "benchmarks.prompts",
    "train": "benchmarks.train",
    "comm": "benchmarks.comm",
    "flower": "benchmarks.flower",
    "deploy": "benchmarks.deploy",
    "privacy": "benchmarks.privacy",
    "async": "benchmarks.async_rounds",
    "poison": "benchmarks.poison",
    "fleet": "benchmarks.fleet",
}
# single-purpose scripts folded in as subcommands (their own flags; `python -m benchmarks NAME --help`)
SCRIPTS = {
    "infer": ("benchmarks.edge_infer", "edge inference images/s at batch 1/8/32, model alone and end to end"),
    "sizes": ("benchmarks.export_sizes", "bundle file sizes and parity per precision"),
    "refresh": ("benchmarks.edge_refresh", "bytes and seconds of a device's bundle refresh"),
    "personalise": ("benchmarks.edge_personalise", "held-out accuracy before/after edge-client train"),
    "zero-shot": ("benchmarks.zero_shot_tiny", "zero-shot top-1 of the shipped tiny CLIP"),
    "headroom": ("benchmarks.prompt_headroom", "centralised upper bound of prompts on the tiny CLIP"),
    "photos": ("benchmarks.real_photos", "site folders of real photos (scikit-image's), offline"),
}


def parse_only(value: str | None) -> list[str]:
    if not value:
        return list(SECTIONS)
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise click.BadParameter(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    return names


def run_sections(names: list[str], options: Options, echo=click.echo) -> tuple[list[Section], list[str]]:
    """Run each section; a failing one is recorded and the rest still run."""
    sections, failed = [], []
    for name in names:
        echo(f"[{name}] running ...", err=True)
        start = time.perf_counter()
        try:
            section = importlib.import_module(SECTIONS[name]).run(options)
        except Exception as err:  # noqa: BLE001 - one broken section must not lose the others' results
            traceback.print_exc(file=sys.stderr)
            failed.append(f"{name}: {type(err).__name__}: {' '.join(str(err).split())[:300]}")
            section = Section(name, notes=[f"FAILED: {failed[-1]}"])
        section.seconds = section.seconds or round(time.perf_counter() - start, 1)
        sections.append(section)
        echo(f"[{name}] {section.seconds:.0f} s", err=True)
    return sections, failed


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]},
             help=__doc__.replace("\n\n    python", "\n\n\b\n    python", 1))
@click.option("--quick", is_flag=True, help="Smoke test: the tiny model, fewest batches and repeats (about a minute).")
@click.option("--only", default=None, metavar="LIST", help=f"Comma-separated sections: {','.join(SECTIONS)}.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where PyTorch runs and which ONNX Runtime provider the edge table uses.")
@click.option("--model", default=None, help="CLIP architecture for edge/prompts/train (default ViT-B-16; "
                                            "fedmvp-tiny with --quick).")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="Intra-op threads (default: all usable cores).")
@click.option("--repeats", type=click.IntRange(min=1), default=None, help="Timing repeats (default 5; 2 with --quick).")
@click.option("--run", "run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="A trained run (e.g. runs/demo-...) for the figures that need real weights (int8 agreement); "
                   "default: the newest runs/demo-*.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for results.json, results.md and plots (default benchmarks/results/<time>).")
@click.option("--json", "as_json", is_flag=True, help="Print results.json to stdout instead of the markdown.")
@click.pass_context
def cli(ctx: click.Context, quick: bool, only: str | None, device: str, model: str | None, threads: int | None,
        repeats: int | None, run_dir: Path | None, out: Path | None, as_json: bool) -> None:
    if ctx.invoked_subcommand is not None:
        return
    from benchmarks import machine, report

    names = parse_only(only)
    count = set_threads(threads)
    out = out or REPO / "benchmarks" / "results" / time.strftime("%Y%m%d-%H%M%S")
    options = Options(quick=quick, device=device, model=model, threads=threads, repeats=repeats, out=out,
                      run=run_dir)
    info = machine.describe(count)
    click.echo(f"machine: {machine.line(info)}", err=True)
    sections, failed = run_sections(names, options)
    command = "python -m benchmarks " + " ".join(sys.argv[1:])
    results = {"command": command.strip(), "machine": info, "options": {
        "quick": quick, "only": names, "device": device, "model": model, "threads": count, "repeats": repeats,
        "run": str(run_dir) if run_dir else None}, "sections": [s.to_json() for s in sections], "failed": failed}
    files = report.write(results, out)
    if as_json:
        click.echo(json.dumps(results, sort_keys=True))
    else:
        click.echo(report.suite_markdown(results))
    click.echo(f"wrote {', '.join(str(f) for f in files)}", err=True)
    if failed:
        for line in failed:
            click.echo(f"error: section {line}", err=True)
        ctx.exit(1)


def _section_command(name: str, module: str) -> click.Command:
    @click.command(name=name, context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                                "help_option_names": []},
                   help=f"The {name} section alone (`--help` for its flags; `--json` prints one object).")
    @click.argument("argv", nargs=-1, type=click.UNPROCESSED)
    def command(argv: tuple[str, ...]) -> None:
        sys.argv[0] = f"python -m benchmarks {name}"  # argparse's prog in the section's --help
        sys.exit(importlib.import_module(module).main(list(argv)))

    return command


for _name, _module in SECTIONS.items():
    cli.add_command(_section_command(_name, _module))
for _name, (_module, _help) in SCRIPTS.items():
    _command = _section_command(_name, _module)
    _command.help = f"{_help} (its own flags: `--help`)."
    cli.add_command(_command)


def main() -> None:
    cli(prog_name="python -m benchmarks")
