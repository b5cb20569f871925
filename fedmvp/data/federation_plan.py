"""The federation's shape without a single image: what a server needs to run rounds across machines.

``build_federation`` lists every site's images and draws every k-shot set, which only a machine
holding all the data can do. The server of a real federation holds none: it needs the sites'
ids, names and class lists, the evaluation sets' names, and an upper bound on each site's training
images (to check the replies). ``plan_record`` computes exactly the ``Federation.record()`` of
``build_federation`` from class lists alone (class-name files, split files or a world's
``world.json``), with ``train_images`` an upper bound (shots x classes x domains) and image counts
of test and evaluation sets unknown (None). tests/test_data_federation.py keeps the two in step.
"""

from __future__ import annotations

from typing import Any

from fedmvp.data.catalog import class_plan, preset_failure
from fedmvp.data.federation import class_groups, client_name, eval_set_name  # the same cut and names
from fedmvp.data.layouts import LayoutError
from fedmvp.presets.schema import DatasetSpec, Preset, PresetError



def _eval(kind: str, spec: DatasetSpec, names: list[str], domain: str | None) -> dict[str, Any]:
    return {"name": eval_set_name(spec.name, kind, domain), "kind": kind, "dataset": spec.name, "domain": domain,
            "classes": names, "images": None}


def _pool_domains(spec: DatasetSpec) -> list[str | None]:
    """The source domains of a training dataset, as ``build_federation`` makes its pools."""
    if spec.layout in ("imagefolder", "coop"):
        return [spec.domain]
    return list(spec.train_domains or [spec.domain or "photo"])


def _dataset(preset: Preset, spec: DatasetSpec, first_id: int) -> tuple[list[dict], list[dict]]:

    plan = class_plan(preset, spec)
    clients: list[dict] = []
    evaluations: list[dict] = []
    if spec.role == "test":
        domains = (spec.test_domains or [spec.domain or "photo"]) if spec.layout in ("synthetic", "domainbed") \
            else [spec.domain]
        used = [plan.class_names[y] for y in plan.used]
        return [], [_eval(spec.eval_kind, spec, used, d) for d in domains]
    if spec.dirichlet_alpha is not None:
        raise ValueError("dirichlet_alpha draws clients from the images themselves: a server without the "
                         "data cannot plan them (cut clients by classes instead)")
    groups = class_groups(preset, spec, plan)
    domains = _pool_domains(spec)
    pool_sets = [domains] if spec.mix_domains and len(domains) > 1 else [[d] for d in domains]
    for sources in pool_sets:
        domain = sources[0] if len(sources) == 1 else None
        for j, group in enumerate(groups):
            clients.append({"id": first_id + len(clients), "name": client_name(preset, spec, domain, len(groups), j),
                            "dataset": spec.name, "domain": domain, "classes": [plan.class_names[y] for y in group],
                            "train_images": preset.train.shots * len(group) * len(sources), "test_images": None})
    for domain in domains:
        if preset.protocol in ("base-to-new", "ssmt"):
            evaluations.append(_eval("base", spec, [plan.class_names[y] for y in plan.trained], domain))
        if preset.protocol == "base-to-new" and plan.new:
            evaluations.append(_eval("new", spec, [plan.class_names[y] for y in plan.new], domain))
    used = [plan.class_names[y] for y in plan.used]
    evaluations += [_eval("domain", spec, used, d) for d in spec.test_domains]
    return clients, evaluations


def plan_record(preset: Preset) -> dict[str, Any]:
    """``{"clients": [...], "evaluations": [...]}`` as ``Federation.record()``, from class lists only."""
    clients: list[dict] = []
    evaluations: list[dict] = []
    for spec in preset.datasets:
        try:
            more_clients, more_evals = _dataset(preset, spec, len(clients))
        except (LayoutError, ValueError, OSError) as exc:
            raise preset_failure(preset, spec, exc) from None
        clients += more_clients
        evaluations += more_evals
    if not clients:
        raise PresetError(f"{preset.path}: no clients")
    return {"clients": clients, "evaluations": evaluations}
