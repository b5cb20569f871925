"""A round of a [federation] run evaluated on one site's folder (`fedmvp evaluate --data DIR`).

An open federation's server holds no site data (docs/architecture.md "Open membership"): a round the
sites did not evaluate when it ran has no metrics on the server. Whoever holds a site's folder can
evaluate it there, exactly as that site's node evaluates a deployed round: the same site built from the
same folder (``load_federation`` with a ``SiteRequest``, the stable held-out share of `fedmvp join
--data`, new classes only evaluated), the same counts (``evaluation.federation_counts``, the
``site_counts`` the ClientApp's evaluate handler calls) and the same combination (``combine_counts``,
the server's), so one site's figures here are its share of what the server would have recorded
(docs/method.md §7).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedmvp.data.federation import SiteRequest
from fedmvp.federated.evaluation import ROW_KEYS, federation_counts
from fedmvp.federated.metrics import Counts, combine_counts
from fedmvp.federated.privacy_budget import round_privacy
from fedmvp.federated.task import task_context
from fedmvp.runs import RunDir, RunError


def evaluate_folder(run: RunDir, round_number: int | None, data: str | Path, name: str | None = None,
                    eval_fraction: float | None = None) -> dict[str, Any]:
    """Zero-shot and tuned metrics of round ``round_number`` (None: the last) on the folder ``data`` of the
    site ``name`` (default: the folder's name; in a run with [[sites]], one of them), with ``counts``:
    (correct, total) per row and set (``local``, ``base``, ``new``), and ``site`` (its name, folder,
    held-out share and images per set). `SiteFolderError` for a folder a join would refuse."""
    config = run.read_config()
    checkpoint = run.load_checkpoint(round_number)
    privacy = round_privacy(run, checkpoint.round)  # a bad [privacy] record refused before any work
    preset = run.preset()
    if preset.federation is None:
        raise RunError(f"{run.path}: --data needs a run of a [federation] preset; this run's sites are the "
                       f"partitions of its [[datasets]] (fedmvp evaluate --run {run.path} where that data is)")
    folder = Path(data).resolve()
    site_name = name or folder.name
    fraction = preset.federation.eval_fraction if eval_fraction is None else float(eval_fraction)
    request = SiteRequest(name=site_name, data=str(folder), eval_fraction=eval_fraction)
    ctx = task_context(run.preset_file(config), run.method(checkpoint), config.get("server_device", "cpu"), request)
    record = ctx.federation.record()
    kinds = {ev["name"]: ev["kind"] for ev in record["evaluations"]}
    result: dict[str, Any] = {"run": str(run.path), "round": checkpoint.round}
    counts: dict[str, dict[str, list[int]]] = {}
    for row, state in (("zero-shot", None), ("tuned", checkpoint.tensors)):
        by_site = federation_counts(ctx, state)  # one site: this folder's
        metrics = combine_counts(record, by_site)
        result[row] = {k: metrics.get(k) for k in ROW_KEYS}
        counts[row] = _by_kind(next(iter(by_site.values())), kinds)
    images = {kind: pair[1] for kind, pair in counts["tuned"].items()}
    result |= {"site": {"name": site_name, "data": str(folder), "eval_fraction": fraction, "images": images},
               "counts": counts}
    return result if privacy is None else {**result, "privacy": privacy}


def _by_kind(counts: Counts, kinds: dict[str, str]) -> dict[str, list[int]]:
    """A site's counts keyed ``local``, ``base``, ``new`` (its sets' kinds) instead of the sets' names."""
    return {kinds.get(name, name): [int(correct), int(total)] for name, (correct, total) in counts.items()}
