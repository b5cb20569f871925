"""A round of a [federation] run evaluated on one site's folder (`fedmvp evaluate --data DIR`).

An open federation's server holds no site data (docs/architecture.md "Open membership"): a round the
sites did not evaluate when it ran has no metrics on the server. Whoever holds a site's folder can
evaluate it there, exactly as that site's node evaluates a deployed round: the same site built from the
same folder (``build_named_site``, the stable held-out share of `fedmvp join --data`, new classes only
evaluated), the same counts (``evaluation.federation_counts``, the ``site_counts`` the ClientApp's
evaluate handler calls) and the same combination (``combine_counts``, the server's), so one site's
figures here are its share of what the server would have recorded (docs/method.md §7). The class set
is the run's own record (RUN/classes.json): a copy of the run directory and the folder are enough.
"""

from __future__ import annotations

import json
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedmvp_formats.shown import shown

from fedmvp.federated.evaluation import ROW_KEYS, federation_counts
from fedmvp.federated.metrics import Counts, combine_counts
from fedmvp.federated.privacy_budget import round_privacy
from fedmvp.runs import RunDir, RunError, recorded_copy

if TYPE_CHECKING:
    from fedmvp.presets.schema import Preset


def evaluate_folder(run: RunDir, round_number: int | None, data: str | Path, name: str | None = None,
                    eval_fraction: float | None = None) -> dict[str, Any]:
    """Zero-shot and tuned metrics of round ``round_number`` (None: the last) on the folder ``data`` of the
    site ``name`` (default: ``default_site_name``), with ``counts``: (correct, total) per row and set
    (``local``, ``base``, ``new``), and ``site`` (its name, folder, held-out share and images per set).
    `SiteFolderError` for a folder a join would refuse.

    Only the run directory is read, never a path it records: at a site, the run is a copy and the server's
    folders are not there. The class set and its phrases come from RUN/classes.json, the preset from its
    recorded copy (docs/howto/open-federation.md "A round the sites did not evaluate")."""
    import torch

    from fedmvp.data.site_federation import build_named_site
    from fedmvp.federated.task import TaskContext
    from fedmvp.model import FedMVP

    config = run.read_config()
    checkpoint = run.load_checkpoint(round_number)
    privacy = round_privacy(run, checkpoint.round)  # a bad [privacy] record refused before any work
    preset = recorded_preset(run, config)
    if preset.federation is None:
        raise RunError(f"{run.path}: --data needs a run of a [federation] preset; this run's sites are the "
                       f"partitions of its [[datasets]] (fedmvp evaluate --run {run.path} where that data is)")
    folder = Path(data).resolve()
    site_name = default_site_name(run, preset, folder) if name is None else _checked_name(run, preset, name)
    fraction = preset.federation.eval_fraction if eval_fraction is None else float(eval_fraction)
    device = config.get("server_device", "cpu")
    with tempfile.TemporaryDirectory(prefix="fedmvp-classes-") as work:
        classes = run.class_set()
        if classes is not None:  # the class set as the run recorded it, not the server's attribute file
            own = Path(work) / "attributes.json"
            own.write_text(json.dumps({c.name: list(c.phrases) for c in classes}), encoding="utf-8")
            preset.federation.attributes = str(own)
        federation = build_named_site(preset, site_name, folder, eval_fraction)
    model = FedMVP.build(*run.clip_spec(), run.method(checkpoint), run.seed, device)
    ctx = TaskContext(preset=preset, federation=federation, clip=model.clip_info, model=model,
                      device=torch.device(device))
    record = federation.record()
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


def recorded_preset(run: RunDir, config: dict[str, Any]) -> Preset:
    """The run's preset from RUN/preset.toml while it holds the recorded text (as `prepare_run` wrote it),
    read where the run is, with no warning about the server's original file; else ``RunDir.preset``."""
    from fedmvp.presets.schema import PresetError, load_preset

    copy, text = run.preset_copy_path, config.get("preset_text")
    try:
        held = copy.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        held = None
    if not isinstance(text, str) or held != recorded_copy(text, Path(str(config.get("preset_dir", "")))):
        return run.preset()
    try:
        return load_preset(copy, check_roots=False)
    except PresetError as err:
        raise RunError(str(err)) from None


def default_site_name(run: RunDir, preset: Preset, folder: Path) -> str:
    """The site a folder is, unnamed: in an open federation the name `fedmvp join` gives by default (this
    host's name: the sites name themselves); in a run whose preset lists [[sites]], the folder's name, or this
    host's, where one of them is listed (else one line asking for --name, listing the sites)."""
    from fedmvp.data.federation_plan import is_open

    host = socket.gethostname()
    if is_open(preset):
        return _checked_name(run, preset, host)
    listed = [s.name for s in preset.sites]
    for candidate in (folder.name, host):
        if candidate in listed:
            return candidate
    raise RunError(f"{run.path}: which site's folder is {shown(folder.name)}? Its name and this host's "
                   f"({shown(host)}) are none of the run's sites ({', '.join(map(shown, listed))}): pass --name NAME")


def _checked_name(run: RunDir, preset: Preset, name: str) -> str:
    """``name`` as this run's sites are named: any name the server can number (open), or a listed one."""
    from fedmvp.data.federation_plan import is_open
    from fedmvp.federated.site_registry import name_problem

    if is_open(preset):
        problem = name_problem(name)
        if problem is not None:
            raise RunError(f"--name {shown(name)}: {problem}")
        return name
    listed = [s.name for s in preset.sites]
    if name not in listed:
        raise RunError(f"{run.path}: no site named {shown(name)} in this run (its sites: {', '.join(map(shown, listed))})")
    return name


def _by_kind(counts: Counts, kinds: dict[str, str]) -> dict[str, list[int]]:
    """A site's counts keyed ``local``, ``base``, ``new`` (its sets' kinds) instead of the sets' names."""
    return {kinds.get(name, name): [int(correct), int(total)] for name, (correct, total) in counts.items()}
