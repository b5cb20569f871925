"""The paper's metrics from counts (docs/method.md §7), wherever the counts were made.

Pure functions, no torch and no data: the server combines what the nodes report with the same code
that combines a central evaluation, so the two agree exactly.
"""

from __future__ import annotations


def loss_summary(metrics: list[dict]) -> dict[str, float]:
    """A round's example-weighted mean training losses from its train replies' metrics; a part (CE,
    consistency) over the replies that report it (edge devices report only the total)."""
    out = {}
    for key in ("train-loss", "train-ce", "train-consistency"):
        pairs = [(float(m[key]), float(m["num-examples"])) for m in metrics if key in m]
        total = sum(w for _, w in pairs)
        out[key] = sum(v * w for v, w in pairs) / total if total else float("nan")
    return out


def harmonic_mean(values: list[float]) -> float:
    if any(v <= 0 for v in values):
        return 0.0
    return len(values) / sum(1.0 / v for v in values)


def _mean(values: list[float]) -> float | None:
    return float(sum(values) / len(values)) if values else None


Counts = dict[str, tuple[int, int]]  # set name ("local" or an evaluation set's name) -> (correct, total)


def evaluation_sites(record: dict) -> dict[str, int]:
    """Which site evaluates each evaluation set (run record ``federation``): the first site of the same
    dataset and domain, else of the same dataset, else site 0 (a test-only dataset). Each set is
    evaluated exactly once, so the federated numbers equal the central ones."""
    clients = sorted(record["clients"], key=lambda c: c["id"])
    sites = {}
    for ev in record["evaluations"]:
        same = [c["id"] for c in clients if c["dataset"] == ev["dataset"] and c["domain"] == ev["domain"]]
        dataset = [c["id"] for c in clients if c["dataset"] == ev["dataset"]]
        sites[ev["name"]] = (same or dataset or [0])[0]
    return sites


SITE_COUNT_KEYS = ("local_sites", "base_sites", "new_sites", "domain_sites", "hm_sites")


def combine_counts(record: dict, counts_by_site: dict[int, Counts]) -> dict[str, float | int | None]:
    """Local (each site on its own classes; mean over a dataset's sites, then over datasets), Base and
    New (label subsets, mean over datasets and domains), HM of the three, Domain; from the sites'
    counts, whoever computed them (one process or the nodes of a federation).

    Each metric is a mean over the sites that hold its set: a site with no image of a set reports no
    count for it (or a zero total) and is left out, never counted as 0 % (docs/method.md §7).
    ``<metric>_sites`` says how many sites contributed to each; ``hm_sites``: the sites that
    contributed to any of Local, Base or New (the parts HM is taken of)."""
    dataset_of = {c["id"]: c["dataset"] for c in record["clients"]}
    kind_of = {ev["name"]: ev["kind"] for ev in record["evaluations"]}
    local: dict[str, list[float]] = {}
    results: dict[str, list[float]] = {"base": [], "new": [], "domain": []}
    sites: dict[str, set[int]] = {"local": set(), "base": set(), "new": set(), "domain": set()}
    for site in sorted(counts_by_site):
        for name, (correct, total) in sorted(counts_by_site[site].items()):
            if not total:
                continue
            if name == "local":
                local.setdefault(dataset_of[site], []).append(correct / total)
                sites["local"].add(site)
            elif name in kind_of:
                results[kind_of[name]].append(correct / total)
                sites[kind_of[name]].add(site)
    per_dataset = [m for m in (_mean(v) for v in local.values()) if m is not None]
    metrics: dict[str, float | int | None] = {
        "local": _mean(per_dataset), "base": _mean(results["base"]), "new": _mean(results["new"]),
        "domain": _mean(results["domain"])}
    parts = [metrics[k] for k in ("local", "base", "new") if metrics[k] is not None]
    metrics["hm"] = harmonic_mean(parts) if parts else None
    sites["hm"] = sites["local"] | sites["base"] | sites["new"]
    metrics |= {f"{k}_sites": len(v) for k, v in sites.items()}
    return metrics


# ---- populations: which sites, classes and images stand behind each metric (docs/method.md §7) ----------
POPULATION_COLUMNS = ("local", "base", "new", "domain")


def counted(record: dict, counts_by_site: dict[int, Counts]) -> dict:
    """``combine_counts`` and the per-site counts it was combined from (``site_counts``, JSON-ready), so a
    later table can pair two evaluations over exactly the same sites (``paired_counts``)."""
    return {**combine_counts(record, counts_by_site), "site_counts": {
        str(site): {name: [int(c), int(t)] for name, (c, t) in sorted(counts.items())}
        for site, counts in sorted(counts_by_site.items())}}


def recorded_counts(metrics: dict) -> dict[int, Counts] | None:
    """The per-site counts an evaluation recorded (``counted``), or None: recorded before they were kept,
    or not readable as counts (never trusted beyond their shape)."""
    raw = metrics.get("site_counts")
    if not isinstance(raw, dict):
        return None
    try:
        out = {int(site): {str(name): (int(pair[0]), int(pair[1])) for name, pair in counts.items()}
               for site, counts in raw.items()}
    except (TypeError, ValueError, IndexError, AttributeError, OverflowError):
        return None
    sane = all(0 <= c <= t for counts in out.values() for c, t in counts.values())
    return out if sane else None  # a count a reply could not have made: no pairing from it


def population(record: dict, counts_by_site: dict[int, Counts]) -> dict[str, dict[str, int]]:
    """Per column (Local, Base, New, Domain): how many sites, classes and images the metric is over."""
    classes_of_site = {c["id"]: set(c.get("classes") or []) for c in record["clients"]}
    evaluations = {ev["name"]: ev for ev in record["evaluations"]}
    out = {k: {"sites": set(), "classes": set(), "images": 0} for k in POPULATION_COLUMNS}
    for site, counts in counts_by_site.items():
        for name, (_, total) in counts.items():
            if not total:
                continue
            if name == "local":
                column, classes = out["local"], classes_of_site.get(site, set())
            elif name in evaluations:
                column, classes = out[evaluations[name]["kind"]], set(evaluations[name].get("classes") or [])
            else:
                continue
            column["sites"].add(site)
            column["classes"] |= classes
            column["images"] += total
    return {k: {"sites": len(v["sites"]), "classes": len(v["classes"]), "images": v["images"]}
            for k, v in out.items()}


def paired_counts(reference: dict[int, Counts], sites: set[int]) -> dict[int, Counts]:
    """``reference``'s counts of exactly ``sites``: zero-shot over the sites that evaluated a tuned round."""
    return {site: counts for site, counts in reference.items() if site in sites}
