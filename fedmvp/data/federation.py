"""A preset turned into clients and evaluation sets: the one call the training code makes.

Protocols (docs/method.md §6 and §7):
* ``base-to-new``: base = the first ceil(C/2) classes (or ``base_classes``) cut into contiguous,
  disjoint clients of ``classes_per_client`` (20); new = the rest. Evaluations "base" and "new":
  label subsets of the test split.
* ``msst``: one client per source domain with all classes; a "domain" evaluation per
  ``test_domains`` entry, over all classes.
* ``ssmt``: contiguous clients of 5 classes over all classes (ImageNet: 200), a "base" evaluation
  on the own test split; ``role = "test"`` datasets are evaluated as ``eval_kind`` ("domain").
* ``dirichlet_alpha`` replaces the class cut: the k-shot set of the base classes is split over
  ``num_clients`` with Dir(alpha) label proportions (the federation holds k shots per class, each
  client a skewed share); a client's label space is the classes it got.

Multi-domain data (synthetic, DomainBed) give one client set per train domain, so each client has
ONE domain and its sentences the matching prefix ("a sketch of a ..."); ``mix_domains`` makes one
set over all domains instead (k shots per class and domain, default prefix). The demo (train photo
+ sketch, test painting) thus has clients "shapes/photo/base-j" and "shapes/sketch/base-j"; "base"
and "new" use the test split of the FIRST train domain (photo: the paper's main table); each
held-out domain is a "domain" evaluation over base + new classes (as the paper's MSST "target = all
classes"), measuring class and domain shift together.

k-shot sets are drawn once per client (seed = preset seed + client id) and verified on the spot: an
unreadable file is reported once and the next image of its class replaces it. Test images are
checked lazily (``ImageDataset``). Every failure is a one-line ``PresetError`` (preset path first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from fedmvp_formats.files import sha256_file

from fedmvp.attributes.files import AttributeFileError, load_attributes
from fedmvp.attributes.sentences import SentenceStyle
from fedmvp.data.dataset import is_readable
from fedmvp.data.layouts import LayoutError, read_coop_split, read_imagefolder
from fedmvp.data.partitions import contiguous_clients, groups_from_names, uncovered
from fedmvp.data.sampling import dirichlet_label_skew, k_shot
from fedmvp.data.catalog import (ClassPlan, Pool, align, class_plan, domain_images, names_file,
                                 preset_failure, source_pools, test_folder, world_root)
from fedmvp.presets.schema import DatasetSpec, Preset, load_preset, preset_path

Sample = tuple[str, int]
DEFAULT_CLASSES_PER_CLIENT = {"base-to-new": 20, "ssmt": 5}


@dataclass
class ClientData:
    """One client: its own label space (labels 0..c-1), k-shot train set, local test set, phrases."""

    client_id: int
    name: str
    dataset: str
    domain: str | None
    class_names: list[str]
    train: list[Sample]
    test: list[Sample]
    attributes: dict[str, list[str]]
    style: SentenceStyle
    global_labels: list[int] = field(default_factory=list)  # dataset label of each own class


@dataclass
class EvalSet:
    """A global-model test set: ``samples`` labelled in ``class_names``' space."""

    kind: str  # "base" | "new" | "domain"
    dataset: str
    domain: str | None
    class_names: list[str]
    samples: list[Sample]
    style: SentenceStyle
    attributes: dict[str, list[str]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return eval_set_name(self.dataset, self.kind, self.domain)


@dataclass
class Federation:
    """Clients, evaluation sets and round sampling of one preset."""

    clients: list[ClientData]
    evaluations: list[EvalSet]
    fraction_per_round: float
    protocol: str
    seed: int = 0
    preset: Preset | None = field(default=None, repr=False)

    @property
    def clients_per_round(self) -> int:
        return max(1, round(len(self.clients) * self.fraction_per_round))

    def record(self) -> dict[str, Any]:
        """What later readers of a run need of the federation (config.json), without building it."""
        return {
            "clients": [{"id": c.client_id, "name": c.name, "dataset": c.dataset, "domain": c.domain,
                         "classes": list(c.class_names), "train_images": len(c.train), "test_images": len(c.test)}
                        for c in self.clients],
            "evaluations": [{"name": e.name, "kind": e.kind, "dataset": e.dataset, "domain": e.domain,
                             "classes": list(e.class_names), "images": len(e.samples)} for e in self.evaluations],
        }


def eval_set_name(dataset: str, kind: str, domain: str | None) -> str:
    """The name an evaluation set travels under (run record, assignment to sites)."""
    return f"{dataset}/{kind}" + (f"/{domain}" if domain else "")


def client_name(preset: Preset, spec: DatasetSpec, domain: str | None, groups: int, j: int) -> str:
    """The name of class group ``j`` of ``groups`` in ``domain`` (None: mixed domains)."""
    prefix = spec.name + (f"/{domain}" if spec.train_domains and domain else "")
    kind = "base" if preset.protocol == "base-to-new" else "part"
    return prefix if preset.protocol == "msst" and groups == 1 else f"{prefix}/{kind}-{j}"


def _relabel(samples: list[Sample], labels: list[int]) -> list[Sample]:
    """Samples of ``labels`` only, relabelled to positions in ``labels``."""
    pos = {y: i for i, y in enumerate(labels)}
    return [(p, pos[y]) for p, y in samples if y in pos]


class _Attributes:
    """Attribute files of one dataset, loaded once per (resolved) path."""

    def __init__(self, preset: Preset, spec: DatasetSpec, root: Path, names: list[str]) -> None:
        self.spec, self.root, self.names, self.k = spec, root, names, preset.train.num_attributes
        self.cache: dict[Path, dict[str, list[str]]] = {}

    def get(self, domain: str | None, classes: list[str]) -> dict[str, list[str]]:
        value = self.spec.attributes
        if value is None:
            if self.spec.layout != "synthetic":
                raise ValueError("no attributes file: set attributes = \"...json\" "
                                 "(fedmvp attributes generate --preset ... writes one)")
            value = "attributes.json"
        if "{domain}" in value:
            if not domain:
                raise ValueError(f"attributes {value!r} names {{domain}} but this set has no domain")
            value = value.replace("{domain}", domain)
        path = self.spec.file_path(value, self.root)
        if path not in self.cache:
            self.cache[path] = load_attributes(path, self.names, k=self.k)
        return {c: self.cache[path][c] for c in classes}


def class_groups(preset: Preset, spec: DatasetSpec, plan: ClassPlan) -> list[list[int]]:
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


def _clients(preset: Preset, spec: DatasetSpec, plan: ClassPlan, pools: list[Pool],
             attrs: _Attributes, first_id: int) -> list[ClientData]:
    """One client set per pool (source domain), or one over all pools with ``mix_domains``."""
    shots = preset.train.shots
    trained = set(plan.trained)
    groups = None if spec.dirichlet_alpha is not None else class_groups(preset, spec, plan)
    pool_sets = [pools] if spec.mix_domains and len(pools) > 1 else [[p] for p in pools]
    clients: list[ClientData] = []

    by_class: dict[int, dict[int, list[Sample]]] = {}  # id(pool) -> label -> samples (ImageNet: 1.3M)
    for p in pools:
        by_class[id(p)] = {}
        for s in p.train:
            by_class[id(p)].setdefault(s[1], []).append(s)

    def pick(members: set[int], seed: int, sources: list[Pool]) -> list[Sample]:
        """k shots per class from each source (so per class and domain when mixed)."""
        return [s for p in sources for s in k_shot(
            [x for y in sorted(members) for x in by_class[id(p)].get(y, [])], shots, seed, keep=is_readable)]

    for sources in pool_sets:
        domain = sources[0].domain if len(sources) == 1 else None
        prefix = spec.name + (f"/{domain}" if spec.train_domains and domain else "")  # dirichlet parts
        test = [s for p in sources for s in p.test]
        if groups is None:
            picked = pick(trained, preset.seed + first_id + len(clients), sources)
            shares = dirichlet_label_skew(picked, spec.num_clients, spec.dirichlet_alpha, preset.seed)
            parts = [(f"{prefix}/dir-{j}", sorted({y for _, y in s}), s) for j, s in enumerate(shares)]
        else:
            parts = []
            for j, group in enumerate(groups):
                picked = pick(set(group), preset.seed + first_id + len(clients) + j, sources)
                have = {y for _, y in picked}
                parts.append((client_name(preset, spec, domain, len(groups), j), [y for y in group if y in have],
                              picked))
        for name, own, picked in parts:
            if not own:
                continue
            names = [plan.class_names[y] for y in own]
            clients.append(ClientData(
                client_id=first_id + len(clients), name=name,
                dataset=spec.name, domain=domain, class_names=names,
                train=_relabel(picked, own), test=_relabel(test, own),
                attributes=attrs.get(domain, names),
                style=SentenceStyle.for_domain(domain, spec.name), global_labels=own))
    covered = {y for c in clients for y in c.global_labels}
    missing = [plan.class_names[y] for y in plan.trained if y not in covered]
    if missing:
        raise ValueError(f"{len(missing)} classes are in no client (no readable training images): "
                         f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    return clients


def _eval(kind: str, spec: DatasetSpec, plan: ClassPlan, labels: list[int], samples: list[Sample],
          domain: str | None, attrs: _Attributes) -> EvalSet:
    names = [plan.class_names[y] for y in labels]
    return EvalSet(kind, spec.name, domain, names, _relabel(samples, labels),
                   SentenceStyle.for_domain(domain, spec.name), attrs.get(domain, names))


def _evaluations(preset: Preset, spec: DatasetSpec, plan: ClassPlan, pools: list[Pool], root: Path,
                 attrs: _Attributes) -> list[EvalSet]:
    sets: list[EvalSet] = []
    if spec.role == "test":
        if spec.layout in ("synthetic", "domainbed"):
            for d in spec.test_domains or [spec.domain or "photo"]:
                sets.append(_eval(spec.eval_kind, spec, plan, plan.used,
                                  domain_images(spec, root, d), d, attrs))
        elif spec.layout == "imagefolder":
            images = read_imagefolder(test_folder(spec), names_file(spec))
            sets.append(_eval(spec.eval_kind, spec, plan, plan.used, align(images, plan.class_names),
                              spec.domain, attrs))
        else:
            samples = read_coop_split(spec.file_path(spec.split_file), spec.file_path(spec.image_dir),
                                      spec.test_split).samples
            sets.append(_eval(spec.eval_kind, spec, plan, plan.used, samples, spec.domain, attrs))
        return sets
    # Base (and New) on the test split of every training domain; evaluate_global averages them.
    for pool in pools:
        if preset.protocol in ("base-to-new", "ssmt"):
            sets.append(_eval("base", spec, plan, plan.trained, pool.test, pool.domain, attrs))
        if preset.protocol == "base-to-new" and plan.new:
            sets.append(_eval("new", spec, plan, plan.new, pool.test, pool.domain, attrs))
    for d in spec.test_domains:
        sets.append(_eval("domain", spec, plan, plan.used,
                          domain_images(spec, root, d), d, attrs))
    return sets


def build_federation(preset: Preset) -> Federation:
    """Clients and evaluation sets of ``preset`` (reads the data; renders the default world if needed)."""
    clients: list[ClientData] = []
    evaluations: list[EvalSet] = []
    for spec in preset.datasets:
        try:
            plan = class_plan(preset, spec)
            root = world_root(spec) if spec.layout == "synthetic" else spec.root_path()
            attrs = _Attributes(preset, spec, root, [plan.class_names[y] for y in plan.used])
            pools = source_pools(preset, spec, plan, root) if spec.role == "train" else []
            if spec.role == "train":
                clients += _clients(preset, spec, plan, pools, attrs, len(clients))
            evaluations += _evaluations(preset, spec, plan, pools, root, attrs)
        except (LayoutError, AttributeFileError, ValueError, OSError) as exc:
            raise preset_failure(preset, spec, exc) from None
    return Federation(clients, evaluations, preset.train.fraction_fit, preset.protocol, preset.seed, preset)


def load_federation(name_or_path: str) -> tuple[Preset, Federation]:
    """The preset and its federation, built ONCE per process and preset file content.

    Listing a dataset and drawing (and verifying) every client's k-shot set is the costly part
    of starting; the run preparation, the ServerApp, evaluation, export and the demo all ask for
    the same federation in one process, so they share this one. An edited preset file is a new
    key (its bytes are hashed), never a stale federation."""
    path = preset_path(name_or_path)
    try:
        digest = sha256_file(path)
    except OSError:
        digest = ""  # load_preset reports the unreadable file in one line
    return _federation(str(path), digest)


@lru_cache(maxsize=4)
def _federation(path: str, digest: str) -> tuple[Preset, Federation]:
    preset = load_preset(path)
    return preset, build_federation(preset)
