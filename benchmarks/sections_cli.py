"""The command line a section module runs alone with (``python -m benchmarks.<name> [--json]``).

Each section's ``main`` hands its ``run`` and table printer here, so every section takes the same
flags as the suite (quick, device, model, threads, repeats) and prints the same JSON record.
"""

from __future__ import annotations

import argparse
import json
import logging
import warnings
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import Options, Section, set_threads


def parse_options(doc: str | None, argv: list[str] | None) -> tuple[Options, bool]:
    """Options from the command line, and whether ``--json`` was asked."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny model, fewest repeats")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", default=None, help="CLIP architecture (default per section)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: all cores)")
    parser.add_argument("--repeats", type=int, default=None, help="timing repeats")
    parser.add_argument("--run", type=Path, default=None,
                        help="a trained run (e.g. `fedmvp demo`'s) for the sections that need real weights")
    parser.add_argument("--out", type=Path, default=None, help="folder for the files a section writes (plots)")
    parser.add_argument("--json", action="store_true", help="print the Section record as one JSON object")
    args = parser.parse_args(argv)
    if args.run is not None and not args.run.is_dir():
        parser.error(f"--run {args.run}: not a directory")
    options = Options(quick=args.quick, device=args.device, model=args.model, threads=args.threads,
                      repeats=args.repeats, run=args.run, out=args.out)
    return options, args.json


def show_ratios(section: Section) -> None:
    """A section's ratios under its table, one per line (- where one could not be measured)."""
    for key, value in section.ratios.items():
        print(f"  {key}: {'-' if value is None else f'{value:.2f}x'}")


def show_goals(section: Section) -> None:
    """Goals and notes under a section's table."""
    for goal in section.goals:
        state = {True: "met", False: "NOT met", None: "not measured"}[goal.met]
        value = "-" if goal.value is None else f"{goal.value:.3f}"
        print(f"goal {goal.name}: {value} (target {goal.target}) {state}")
    for note in section.notes:
        print(f"note: {note}")
    print(f"({section.seconds:.1f} s)")


def show_table(section: Section) -> None:
    """The rows as a markdown table and the ratios (goals and notes follow from ``show_goals``)."""
    from benchmarks.report import table

    print(table(section.rows))
    print("ratios: " + ", ".join(f"{k} {v:.3g}" for k, v in section.ratios.items() if v is not None))


def section_main(run: Callable[[Options], Section], show: Callable[[Section], None], doc: str | None,
                 argv: list[str] | None = None) -> int:
    """Parse flags, run the section, print JSON or ``show``'s table and the goals."""
    options, as_json = parse_options(doc, argv)
    set_threads(options.threads)
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    section = run(options)
    if as_json:
        print(json.dumps(section.to_json(), sort_keys=True))
    else:
        show(section)
        show_goals(section)
    return 0
