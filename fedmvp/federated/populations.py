"""Zero-shot against tuned over the same sites, and what stands behind each column (docs/method.md §7).

Why: an evaluation is a mean over the sites that answered it. When a site died between the zero-shot
evaluation and a tuned round's, the two rows are means over different populations, and their difference
says nothing about tuning. Each evaluation records its per-site counts (``metrics.counted``); here both
rows are combined again over the sites both hold (``paired_counts``), the unpaired figures kept beside
them, and each row says how many sites, classes and images it is over (``metrics.population``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fedmvp_formats.shown import name_shown

from fedmvp.federated.metrics import POPULATION_COLUMNS, combine_counts, paired_counts, population, recorded_counts

ROWS = ("zero-shot", "tuned")


def compare_populations(record: dict, zero_shot: dict, tuned: dict, keys: Sequence[str]) -> dict[str, Any]:
    """The table's two rows over the same sites: ``zero-shot`` and ``tuned`` (combined again over the sites
    both evaluations hold when they differ), ``population`` (per row and column: sites, classes, images),
    and, where the sites differed, ``unpaired`` (the rows as recorded) and ``note`` (one line saying so)."""
    def row(metrics: dict) -> dict:
        return {k: metrics.get(k) for k in keys}

    counts = {"zero-shot": recorded_counts(zero_shot), "tuned": recorded_counts(tuned)}
    rows = {"zero-shot": row(zero_shot), "tuned": row(tuned)}
    known = {c["id"] for c in record["clients"]}
    if any(c is None or not set(c) <= known for c in counts.values()):  # recorded before per-site counts were kept
        shown = {name: {c: {"sites": metrics.get(f"{c}_sites")} for c in POPULATION_COLUMNS}
                 for name, metrics in (("zero-shot", zero_shot), ("tuned", tuned))}
        differ = zero_shot.get("hm") is not None and any(
            shown["zero-shot"][c]["sites"] != shown["tuned"][c]["sites"] for c in POPULATION_COLUMNS)
        note = {"note": "populations differ (see the sites under each row) and this run recorded no per-site "
                        "counts to pair them: the rows are not comparable"} if differ else {}
        return {**rows, "population": shown, **note}
    both = set(counts["zero-shot"]) & set(counts["tuned"])
    if set(counts["zero-shot"]) == set(counts["tuned"]):
        return {**rows, "population": {name: population(record, c) for name, c in counts.items()}}
    paired = {name: paired_counts(c, both) for name, c in counts.items()}
    return {name: row(combine_counts(record, c)) for name, c in paired.items()} | {
        "population": {name: population(record, c) for name, c in paired.items()},
        "unpaired": rows, "note": _note(record, counts, both)}


def _site_names(record: dict, sites: set[int]) -> str:
    names = {c["id"]: c.get("name") for c in record["clients"]}
    return ", ".join(f"site {s}" + (f" ({name_shown(str(names[s]))})" if names.get(s) is not None else "")
                     for s in sorted(sites))


def _note(record: dict, counts: dict[str, dict], both: set[int]) -> str:
    """One line: which sites one evaluation lacks, and that both rows are over the sites they share."""
    missing = []
    for name, other in (("tuned", "zero-shot"), ("zero-shot", "tuned")):
        lacking = set(counts[other]) - set(counts[name])
        if lacking:
            missing.append(f"the {name} evaluation lacks {_site_names(record, lacking)}")
    return (f"populations differ: {'; '.join(missing)}; both rows above are over the {_count(len(both), 'site')} "
            f"both evaluated")


def population_lines(result: dict) -> list[str]:
    """The lines under the table: what each row is over, and the note where populations differed."""
    populations = result.get("population")
    if not populations:
        return []
    described = {name: _described(populations.get(name) or {}) for name in ROWS}
    if described["zero-shot"] == described["tuned"]:
        lines = [f"both rows over: {described['tuned']}"]
    else:
        lines = [f"{name} over: {described[name]}" for name in ROWS]
    if result.get("unpaired"):
        lines.append(f"{result['note']}; as recorded: {_unpaired(result['unpaired'])}")
    elif result.get("note"):
        lines.append(result["note"])
    return lines + _one_way(populations)


def _one_way(populations: dict) -> list[str]:
    """A column over one class is a 1-way choice: 100% whatever the model, so it is flagged, not shown bare
    (docs/method.md: base and new classes)."""
    single = [column.capitalize() for column in POPULATION_COLUMNS
              if any((populations.get(name) or {}).get(column, {}).get("classes") == 1 for name in ROWS)]
    return [f"warning: {column} is over 1 class: a 1-way choice, 100% whatever the model"
            f"{' (HM with it)' if column in ('Base', 'New') else ''}; hold out two or more classes for a figure "
            f"that means something" for column in single]


def _described(columns: dict) -> str:
    """``Local 3 sites, 6 classes, 48 images; Base ...``: the columns some site is behind."""
    parts = []
    for column in POPULATION_COLUMNS:
        figures = columns.get(column) or {}
        if not figures.get("sites"):
            continue
        words = [_count(figures[k], noun) for k, noun in (("sites", "site"), ("classes", "class"), ("images", "image"))
                 if k in figures]
        parts.append(f"{column.capitalize()} {', '.join(words)}")
    return "; ".join(parts) or "no site"


def _count(number: int, noun: str) -> str:
    """``1 site``, ``2 sites``, ``1 class``, ``3 classes``."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}{'es' if noun.endswith('s') else 's'}"


def _unpaired(rows: dict) -> str:
    """The rows as recorded, in the table's units: ``zero-shot HM 40.53, tuned HM 47.35``."""
    def cell(value: Any) -> str:
        return "-" if value is None else f"{100 * value:.2f}"

    return ", ".join(f"{name} " + " ".join(f"{k.capitalize() if k != 'hm' else 'HM'} {cell(rows[name].get(k))}"
                                           for k in ("local", "base", "new", "hm")) for name in ROWS)
