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

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

from fedmvp_formats.files import sha256_file

from fedmvp.attributes.files import AttributeFileError, load_attributes
from fedmvp.attributes.sentences import SentenceStyle
from fedmvp.data.image_decode import is_readable
from fedmvp.data.layout_table import layout_of
from fedmvp.data.layouts import LayoutError
from fedmvp.data.federation_plan import (ClientPlan, DatasetPlan, EvalPlan, eval_set_name, plan_dataset,
                                         plan_federation)
from fedmvp.data.federation_types import ClientData, EvalSet, Federation, relabel
from fedmvp.data.sampling import dirichlet_label_skew, k_shot
from fedmvp.data.site_federation import build_named_site, build_sites
from fedmvp.data.catalog import ClassPlan, Pool, dataset_root, preset_failure, source_pools, test_images
from fedmvp.presets.schema import DatasetSpec, Preset, PresetError, load_preset, preset_path

Sample = tuple[str, int]
__all__ = ["ClientData", "EvalSet", "Federation", "build_federation", "build_site", "eval_set_name",
           "load_federation", "SiteRequest"]


class _Attributes:
    """Attribute files of one dataset, loaded once per (resolved) path."""

    def __init__(self, preset: Preset, spec: DatasetSpec, root: Path, names: list[str]) -> None:
        self.spec, self.root, self.names, self.k = spec, root, names, preset.train.num_attributes
        self.cache: dict[Path, dict[str, list[str]]] = {}

    def get(self, domain: str | None, classes: list[str]) -> dict[str, list[str]]:
        value = self.spec.attributes
        if value is None:
            value = layout_of(self.spec.layout).default_attributes
            if value is None:
                raise ValueError("no attributes file: set attributes = \"...json\" "
                                 "(fedmvp attributes generate --preset ... writes one)")
        if "{domain}" in value:
            if not domain:
                raise ValueError(f"attributes {value!r} names {{domain}} but this set has no domain")
            value = value.replace("{domain}", domain)
        path = self.spec.file_path(value, self.root)
        if path not in self.cache:
            self.cache[path] = load_attributes(path, self.names, k=self.k)
        return {c: self.cache[path][c] for c in classes}


def _client(preset: Preset, spec: DatasetSpec, plan: ClassPlan, cp: ClientPlan, pools: list[Pool],
            attrs: _Attributes) -> ClientData:
    """One planned client materialised: ``shots`` per class from each source pool, seeded by its id."""
    sources = [p for p in pools if p.domain in cp.sources]
    picked = [s for p in sources for s in k_shot([x for x in p.train if x[1] in set(cp.labels)],
                                                   preset.train.shots, cp.seed, keep=is_readable)]
    have = {y for _, y in picked}
    missing = [plan.class_names[y] for y in cp.labels if y not in have]
    if missing:
        raise ValueError(f"{len(missing)} classes are in no client (no readable training images): "
                         f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    own = list(cp.labels)
    return ClientData(client_id=cp.client_id, name=cp.name, dataset=spec.name, domain=cp.domain,
                      class_names=list(cp.class_names), train=relabel(picked, own),
                      test=relabel([s for p in sources for s in p.test], own),
                      attributes=attrs.get(cp.domain, list(cp.class_names)),
                      style=SentenceStyle.for_domain(cp.domain, spec.name), global_labels=own)


def _drawn_clients(preset: Preset, spec: DatasetSpec, plan: ClassPlan, pools: list[Pool],
                   attrs: _Attributes, first_id: int) -> list[ClientData]:
    """``dirichlet_alpha``: the k-shot set of the base classes split over clients with Dir(alpha)
    label proportions; the clients come from the images, so they cannot be planned without them."""
    pool_sets = [pools] if spec.mix_domains and len(pools) > 1 else [[p] for p in pools]
    clients: list[ClientData] = []
    for sources in pool_sets:
        domain = sources[0].domain if len(sources) == 1 else None
        prefix = spec.name + (f"/{domain}" if spec.train_domains and domain else "")
        picked = [s for p in sources for s in k_shot([x for x in p.train if x[1] in set(plan.trained)],
                                                       preset.train.shots, preset.seed + first_id + len(clients),
                                                       keep=is_readable)]
        shares = dirichlet_label_skew(picked, spec.num_clients, spec.dirichlet_alpha, preset.seed)
        test = [s for p in sources for s in p.test]
        for j, share in enumerate(shares):
            own = sorted({y for _, y in share})
            if not own:
                continue
            names = [plan.class_names[y] for y in own]
            clients.append(ClientData(
                client_id=first_id + len(clients), name=f"{prefix}/dir-{j}", dataset=spec.name, domain=domain,
                class_names=names, train=relabel(share, own), test=relabel(test, own),
                attributes=attrs.get(domain, names), style=SentenceStyle.for_domain(domain, spec.name),
                global_labels=own))
    covered = {y for c in clients for y in c.global_labels}
    missing = [plan.class_names[y] for y in plan.trained if y not in covered]
    if missing:
        raise ValueError(f"{len(missing)} classes are in no client (no readable training images): "
                         f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    return clients


def _eval_set(preset: Preset, spec: DatasetSpec, plan: ClassPlan, ev: EvalPlan, root: Path,
              pools: Callable[[list[str | None], set[int]], list[Pool]], attrs: _Attributes) -> EvalSet:
    """One planned evaluation set materialised (a held-out domain, a test dataset, or a training
    domain's test split restricted to the set's classes)."""
    labels = list(ev.labels)
    if spec.role == "test" or ev.kind == "domain":
        samples = test_images(spec, plan, root, ev.domain)
    else:
        samples = [s for p in pools([ev.domain], set(labels)) for s in p.test]
    names = list(ev.class_names)
    return EvalSet(ev.kind, spec.name, ev.domain, names, relabel(samples, labels),
                   SentenceStyle.for_domain(ev.domain, spec.name), attrs.get(ev.domain, names))


class _Dataset:
    """One dataset's plan and the means to read its images (pools listed once, or per site)."""

    def __init__(self, preset: Preset, plan: DatasetPlan, whole: bool) -> None:
        self.preset, self.plan, self.spec = preset, plan, plan.spec
        spec = self.spec
        self.root = dataset_root(spec)
        self.attrs = _Attributes(preset, spec, self.root, [plan.classes.class_names[y] for y in plan.classes.used])
        self._all = source_pools(preset, spec, plan.classes, self.root) if whole and spec.role == "train" else None

    def pools(self, domains: list[str | None], labels: set[int]) -> list[Pool]:
        if self._all is not None:  # every client of the federation: listed once, filtered per client
            return [Pool(p.domain, [s for s in p.train if s[1] in labels], [s for s in p.test if s[1] in labels])
                    for p in self._all if p.domain in domains]
        return source_pools(self.preset, self.spec, self.plan.classes, self.root, domains, labels)

    def client(self, cp: ClientPlan) -> ClientData:
        return _client(self.preset, self.spec, self.plan.classes, cp, self.pools(list(cp.sources), set(cp.labels)),
                       self.attrs)

    def evaluation(self, ev: EvalPlan) -> EvalSet:
        return _eval_set(self.preset, self.spec, self.plan.classes, ev, self.root, self.pools, self.attrs)


def build_federation(preset: Preset) -> Federation:
    """Every planned client and evaluation set of ``preset`` materialised (reads all the data; renders
    the default world if needed): the simulation's and a central evaluation's federation."""
    if preset.federation is not None:
        return build_sites(preset)
    clients: list[ClientData] = []
    evaluations: list[EvalSet] = []
    for spec in preset.datasets:
        try:
            data = _Dataset(preset, plan_dataset(preset, spec, len(clients)), whole=True)
            if data.plan.drawn:
                clients += _drawn_clients(preset, spec, data.plan.classes, data._all, data.attrs, len(clients))
            clients += [data.client(cp) for cp in data.plan.clients]
            evaluations += [data.evaluation(ev) for ev in data.plan.evaluations]
        except (LayoutError, AttributeFileError, ValueError, OSError) as exc:
            raise preset_failure(preset, spec, exc) from None
    return Federation(clients, evaluations, preset.train.fraction_fit, preset.protocol, preset.seed, preset)


def build_site(preset: Preset, site: int) -> Federation:
    """ONE site of a paper preset materialised: its client and the evaluation sets assigned to it
    (``evaluation_sites`` of the plan). Only its own classes are listed and drawn, with the seed it
    has among all, so its shots equal ``build_federation``'s. A drawn (Dirichlet) cut needs them all."""
    from fedmvp.federated.metrics import evaluation_sites

    plans = plan_federation(preset)
    if any(p.drawn for p in plans):
        whole = build_federation(preset)
        return Federation([c for c in whole.clients if c.client_id == site], whole.evaluations,
                          whole.fraction_per_round, whole.protocol, whole.seed, preset)
    record = {"clients": [c.record() for p in plans for c in p.clients],
              "evaluations": [e.record() for p in plans for e in p.evaluations]}
    if site not in {c["id"] for c in record["clients"]}:
        raise PresetError(f"{preset.path}: no site {site} (the preset has {len(record['clients'])} sites: "
                          f"0..{len(record['clients']) - 1})")
    assigned = {name for name, s in evaluation_sites(record).items() if s == site}
    clients: list[ClientData] = []
    evaluations: list[EvalSet] = []
    for plan in plans:
        mine = [c for c in plan.clients if c.client_id == site]
        sets = [e for e in plan.evaluations if e.name in assigned]
        if not (mine or sets):
            continue
        try:
            data = _Dataset(preset, plan, whole=False)
            clients += [data.client(cp) for cp in mine]
            evaluations += [data.evaluation(ev) for ev in sets]
        except (LayoutError, AttributeFileError, ValueError, OSError) as exc:
            raise preset_failure(preset, plan.spec, exc) from None
    return Federation(clients, evaluations, preset.train.fraction_fit, preset.protocol, preset.seed, preset)


@dataclass(frozen=True)
class SiteRequest:
    """Which ONE site a process materialises: a paper preset's ``site`` (its partition id), or a
    [federation] site by ``name`` from its ``data`` folder (``eval_fraction`` overrides the preset's;
    ``site``: in an open federation, the id the server gave the name)."""

    site: int | None = None
    name: str | None = None
    data: str | None = None
    eval_fraction: float | None = None
    attributes: str | None = None  # the run's class set as received, in place of the preset's attribute file


def load_federation(name_or_path: str, site: SiteRequest | None = None) -> tuple[Preset, Federation]:
    """The preset and its federation (``site``: only that site's part), built ONCE per process and
    preset file content.

    Listing a dataset and drawing (and verifying) every client's k-shot set is the costly part
    of starting; the run preparation, the ServerApp, evaluation, export and the demo all ask for
    the same federation in one process, so they share this one. An edited preset file is a new
    key (its bytes are hashed), never a stale federation."""
    path = preset_path(name_or_path)
    try:
        digest = sha256_file(path)
    except OSError:
        digest = ""  # load_preset reports the unreadable file in one line
    return _federation(str(path), digest, site)


@lru_cache(maxsize=4)
def _federation(path: str, digest: str, site: SiteRequest | None) -> tuple[Preset, Federation]:
    preset = load_preset(path, check_roots=site is None)
    if site is None:
        return preset, build_federation(preset)
    if site.attributes is not None:  # the run's class set taken from the server (fedmvp join --classes-from-server)
        from fedmvp.federated.site_classes import with_attributes

        preset = with_attributes(preset, site.attributes)
    if site.data is not None:
        if preset.federation is None:
            raise PresetError(f"{preset.path}: a site folder (--data) needs a [federation] preset; "
                              f"a [[datasets]] preset's site is chosen by --site N")
        return preset, build_named_site(preset, str(site.name), site.data, site.eval_fraction, site.site)
    if site.site is None:
        raise PresetError(f"{preset.path}: no site given (a site number, or a name and its folder)")
    if preset.federation is not None:
        raise PresetError(f"{preset.path}: a [federation] site brings its folder (fedmvp join --data DIR --name NAME)")
    return preset, build_site(preset, site.site)
