"""The federation planned from class lists alone: who the sites are, what each holds, what is evaluated.

The one planner (docs/architecture.md "Built once per process"): ``build_federation`` materialises
every planned client (a simulation, a central evaluation), ``build_site`` materialises ONE (a site's
process, which must not list or sample other sites' data), and a server without data writes the
plan's record (``plan_record``). A client's k-shot draw is seeded by its planned id
(``preset.seed + id``), so one site drawn alone gets exactly the shots it gets among all.

Paper presets (``[[datasets]]``) plan from class-name files, split files or a world's ``world.json``;
a ``[federation]`` preset plans from its class set (the attribute file) and its ``[[sites]]`` (or, open
membership, the names its server has numbered): one client per site, whose evaluation sets (base, new) are its own held-out images (the site's name is
the sets' "domain", so each site evaluates its own). ``dirichlet_alpha`` draws clients from the
images themselves and cannot be planned without them (``build_federation`` draws it from the data).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedmvp.attributes.files import AttributeFileError, read_attribute_file
from fedmvp.data.catalog import ClassPlan, class_plan, preset_failure
from fedmvp.data.layout_table import layout_of
from fedmvp.data.layouts import LayoutError
from fedmvp.data.partitions import contiguous_clients, groups_from_names, uncovered
from fedmvp.presets.schema import DatasetSpec, Preset, PresetError

DEFAULT_CLASSES_PER_CLIENT = {"base-to-new": 20, "ssmt": 5}


@dataclass(frozen=True)
class ClientPlan:
    """One client before any image is read: id, name, its classes (dataset labels) and where they are."""

    client_id: int
    name: str
    dataset: str
    domain: str | None
    sources: tuple[str | None, ...]  # the source domains its shots are drawn from
    labels: tuple[int, ...]  # its classes, as labels of the dataset (or of the federation's class set)
    class_names: tuple[str, ...]
    seed: int  # its k-shot draw: preset seed + client id
    train_bound: int | None  # the most training images it can report (None: a site's whole folder)
    site_data: Path | None = None  # [federation]: the site's folder (simulation)

    def record(self) -> dict[str, Any]:
        return {"id": self.client_id, "name": self.name, "dataset": self.dataset, "domain": self.domain,
                "classes": list(self.class_names), "train_images": self.train_bound, "test_images": None}


@dataclass(frozen=True)
class EvalPlan:
    """One evaluation set: its kind, the classes it is scored over (dataset labels) and its domain."""

    kind: str
    dataset: str
    domain: str | None
    labels: tuple[int, ...]
    class_names: tuple[str, ...]

    @property
    def name(self) -> str:
        return eval_set_name(self.dataset, self.kind, self.domain)

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "dataset": self.dataset, "domain": self.domain,
                "classes": list(self.class_names), "images": None}


@dataclass
class DatasetPlan:
    """What one dataset (or the [federation]) contributes: its class plan, clients and evaluations."""

    spec: DatasetSpec | None  # None: the [federation]
    classes: ClassPlan
    clients: list[ClientPlan] = field(default_factory=list)
    evaluations: list[EvalPlan] = field(default_factory=list)
    drawn: bool = False  # dirichlet: clients come from the images (build_federation draws them)


def eval_set_name(dataset: str, kind: str, domain: str | None) -> str:
    """The name an evaluation set travels under (run record, assignment to sites)."""
    return f"{dataset}/{kind}" + (f"/{domain}" if domain else "")


def client_name(preset: Preset, spec: DatasetSpec, domain: str | None, groups: int, j: int) -> str:
    """The name of class group ``j`` of ``groups`` in ``domain`` (None: mixed domains)."""
    prefix = spec.name + (f"/{domain}" if spec.train_domains and domain else "")
    kind = "base" if preset.protocol == "base-to-new" else "part"
    return prefix if preset.protocol == "msst" and groups == 1 else f"{prefix}/{kind}-{j}"


def class_groups(preset: Preset, spec: DatasetSpec, plan: ClassPlan) -> list[list[int]]:
    """The class cut: explicit ``clients`` lists, else contiguous groups of ``classes_per_client``."""
    if spec.clients is not None:
        groups = groups_from_names(spec.clients, plan.class_names)
        extra = [plan.class_names[y] for g in groups for y in g if y not in set(plan.trained)]
        if extra:
            raise ValueError(f"clients name classes that are not trained (new/unused): {', '.join(extra[:5])}")
    else:
        per = spec.classes_per_client or DEFAULT_CLASSES_PER_CLIENT.get(preset.protocol, len(plan.trained))
        groups = contiguous_clients(plan.trained, per, spec.num_clients)
    missing = uncovered(plan.trained, groups)
    if missing:
        raise ValueError(f"{len(missing)} classes are in no client: "
                         f"{', '.join(plan.class_names[y] for y in missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}")
    return groups


def pool_domains(spec: DatasetSpec) -> list[str | None]:
    """The source domains of a training dataset (one pool each)."""
    return layout_of(spec.layout).pool_domains(spec)


def _eval(kind: str, spec_name: str, plan: ClassPlan, labels: list[int], domain: str | None) -> EvalPlan:
    return EvalPlan(kind, spec_name, domain, tuple(labels), tuple(plan.class_names[y] for y in labels))


def plan_dataset(preset: Preset, spec: DatasetSpec, first_id: int) -> DatasetPlan:
    """One dataset's plan, its clients numbered from ``first_id``."""
    plan = class_plan(preset, spec)
    out = DatasetPlan(spec, plan)
    if spec.role == "test":
        domains = layout_of(spec.layout).eval_domains(spec)
        out.evaluations = [_eval(spec.eval_kind, spec.name, plan, plan.used, d) for d in domains]
        return out
    domains = pool_domains(spec)
    if spec.dirichlet_alpha is not None:
        out.drawn = True
    else:
        groups = class_groups(preset, spec, plan)
        pool_sets = [domains] if spec.mix_domains and len(domains) > 1 else [[d] for d in domains]
        for sources in pool_sets:
            domain = sources[0] if len(sources) == 1 else None
            for j, group in enumerate(groups):
                cid = first_id + len(out.clients)
                out.clients.append(ClientPlan(
                    cid, client_name(preset, spec, domain, len(groups), j), spec.name, domain, tuple(sources),
                    tuple(group), tuple(plan.class_names[y] for y in group), preset.seed + cid,
                    preset.train.shots * len(group) * len(sources)))
    for domain in domains:
        if preset.protocol in ("base-to-new", "ssmt"):
            out.evaluations.append(_eval("base", spec.name, plan, plan.trained, domain))
        if preset.protocol == "base-to-new" and plan.new:
            out.evaluations.append(_eval("new", spec.name, plan, plan.new, domain))
    out.evaluations += [_eval("domain", spec.name, plan, plan.used, d) for d in spec.test_domains]
    return out


def federation_classes(preset: Preset) -> ClassPlan:
    """A [federation]'s class set (its attribute file's classes, in file order): base and new."""
    fed = preset.federation
    path = fed.attributes_path()
    names = list(read_attribute_file(path)[0])
    unknown = [c for c in fed.new_classes if c not in names]
    if unknown:
        raise ValueError(f"new_classes {unknown[0]!r} is not a class of {path}")
    new = [i for i, c in enumerate(names) if c in set(fed.new_classes)]
    return ClassPlan(names, [i for i in range(len(names)) if i not in set(new)], new)


def plan_sites(preset: Preset, names: list[str] | None = None) -> DatasetPlan:
    """One client per site (id: its place), and each site's own base and new sets. ``names``: the sites
    in id order, default the preset's [[sites]]; an open federation's (no [[sites]]) are the names its
    server has numbered so far (``fedmvp.federated.site_registry``), with no folder of theirs here."""
    plan = federation_classes(preset)
    out = DatasetPlan(None, plan)
    folders = {s.name: s.data_path() for s in preset.sites if s.data}
    for i, name in enumerate([s.name for s in preset.sites] if names is None else names):
        out.clients.append(ClientPlan(i, name, preset.name, name, (name,), tuple(plan.trained),
                                      tuple(plan.class_names[y] for y in plan.trained), preset.seed + i, None,
                                      folders.get(name)))
        out.evaluations.append(_eval("base", preset.name, plan, plan.trained, name))
        if plan.new:
            out.evaluations.append(_eval("new", preset.name, plan, plan.new, name))
    return out


def plan_federation(preset: Preset, names: list[str] | None = None) -> list[DatasetPlan]:
    """Every dataset's plan (or the [federation]'s, of ``names``: ``plan_sites``), clients numbered
    across datasets."""
    if preset.federation is not None:
        try:
            return [plan_sites(preset, names)]
        except (AttributeFileError, ValueError, OSError) as exc:
            raise PresetError(f"{preset.path}: [federation]: {' '.join(str(exc).split())}") from None
    plans: list[DatasetPlan] = []
    first = 0
    for spec in preset.datasets:
        try:
            plans.append(plan_dataset(preset, spec, first))
        except (LayoutError, ValueError, OSError) as exc:
            raise preset_failure(preset, spec, exc) from None
        first += len(plans[-1].clients)  # after a drawn cut: known only once drawn (plan_record refuses it)
    return plans


def is_open(preset: Preset) -> bool:
    """An open federation: a [federation] preset without [[sites]], whose sites join by name and are
    numbered by the server as they first appear (docs/architecture.md "Open membership")."""
    return preset.federation is not None and not preset.sites


def plan_record(preset: Preset, names: list[str] | None = None) -> dict[str, Any]:
    """``{"clients": [...], "evaluations": [...]}`` from class lists only (a server without data):
    ``train_images`` an upper bound (shots x classes x domains; None: a site's whole folder).
    An open federation's record holds the sites of ``names`` (none before any joined)."""
    plans = plan_federation(preset, names)
    drawn = next((p for p in plans if p.drawn), None)
    if drawn is not None:
        raise preset_failure(preset, drawn.spec, ValueError(
            "dirichlet_alpha draws clients from the images themselves: a server without the data cannot plan "
            "them (cut clients by classes instead)"))
    clients = [c.record() for p in plans for c in p.clients]
    if not clients and not is_open(preset):
        raise PresetError(f"{preset.path}: no clients")
    return {"clients": clients, "evaluations": [e.record() for p in plans for e in p.evaluations]}
