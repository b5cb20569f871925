"""A ``[federation]`` preset's sites materialised from their own folders (docs/architecture.md
"Sites that hold their own data").

The plan (``federation_plan.plan_sites``) names the sites and the class set; each site's images come
from its folder alone (``site_folder.read_site_folder``): a simulation reads every ``[[sites]]``
folder (``build_sites``), a site's process only its own (``build_named_site``, `fedmvp join --data`;
in an open federation, no [[sites]], with the id the server gave its name).
A site's label space is the base classes it holds; its evaluation sets are its own held-out images
of base classes ("base") and every image it holds of a new class ("new"), scored over the whole
base or new class set, so each site evaluates where its data is.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from fedmvp_formats.folder_walk import within
from fedmvp_formats.shown import path_shown

from fedmvp.attributes.files import AttributeFileError, load_attributes
from fedmvp.attributes.sentences import SentenceStyle
from fedmvp.data.image_decode import is_readable
from fedmvp.data.federation_types import ClientData, EvalSet, Federation, relabel
from fedmvp.data.federation_plan import ClientPlan, DatasetPlan, is_open, plan_federation
from fedmvp.data.sampling import k_shot
from fedmvp.data.site_folder import SiteFolderError, SiteImages, read_site_folder
from fedmvp.presets.schema import Preset, PresetError


def _materialise(preset: Preset, plan: DatasetPlan, cp: ClientPlan, images: SiteImages,
                 attributes: dict[str, list[str]]) -> tuple[ClientData, list[EvalSet]]:
    classes = plan.classes
    own = images.classes(classes.trained)
    train = images.train if preset.train.shots is None else \
        k_shot(images.train, preset.train.shots, cp.seed, keep=is_readable)
    style = site_style(preset)
    names = [classes.class_names[y] for y in own]
    client = ClientData(client_id=cp.client_id, name=cp.name, dataset=preset.name, domain=cp.domain,
                        class_names=names, train=relabel(train, own), test=relabel(images.test, own),
                        attributes={c: attributes[c] for c in names}, style=style, global_labels=own,
                        duplicate_images=images.duplicates)
    sets = []
    for kind, labels in (("base", classes.trained), ("new", classes.new)):
        samples = relabel(images.test, labels)
        if labels and samples:  # a set this site holds no image of is evaluated elsewhere
            set_names = [classes.class_names[y] for y in labels]
            sets.append(EvalSet(kind, preset.name, cp.domain, set_names, samples, style,
                                {c: attributes[c] for c in set_names}))
    return client, sets


def _site_images(preset: Preset, plan: DatasetPlan, folder: Path, eval_fraction: float | None) -> SiteImages:
    fed = preset.federation
    return read_site_folder(folder, plan.classes.class_names, list(fed.new_classes),
                            fed.eval_fraction if eval_fraction is None else eval_fraction)


def site_style(preset: Preset) -> SentenceStyle:
    """The sentence style of every set of a [federation] (its name as the domain's)."""
    return SentenceStyle.for_domain(None, preset.name)


def site_attributes(preset: Preset, plan: DatasetPlan) -> dict[str, list[str]]:
    """The class set's phrases, cut to the preset's K (one line naming the preset on a bad file)."""
    path = preset.federation.attributes_path()
    try:
        return load_attributes(path, plan.classes.class_names, k=preset.train.num_attributes)
    except AttributeFileError as exc:
        raise PresetError(f"{preset.path}: [federation]: {exc}") from None


def build_sites(preset: Preset) -> Federation:
    """Every ``[[sites]]`` folder of a [federation] preset (the simulation on one machine)."""
    plan = plan_federation(preset)[0]
    if not plan.clients:
        raise PresetError(f"{preset.path}: a [federation] simulation needs [[sites]] with their data folders")
    attributes = site_attributes(preset, plan)
    clients, evaluations = [], []
    folders: dict[str, str] = {}  # real folder -> the site that reads it
    for cp in plan.clients:
        if cp.site_data is None:
            raise PresetError(f"{preset.path}: site {cp.name!r} has no data folder (data = \"...\") to simulate")
        _one_site_per_folder(preset, cp, folders)
        try:
            images = _site_images(preset, plan, cp.site_data, None)
        except SiteFolderError as err:
            raise PresetError(f"{preset.path}: site {cp.name!r}: {err.problems[0]}"
                              + (f" (and {len(err.problems) - 1} more problems)" if len(err.problems) > 1 else ""))
        client, sets = _materialise(preset, plan, cp, images, attributes)
        clients.append(client)
        evaluations += sets
    return Federation(clients, evaluations, preset.train.fraction_fit, preset.protocol, preset.seed, preset)


def _one_site_per_folder(preset: Preset, cp: ClientPlan, folders: dict[str, str]) -> None:
    """Two sites of one simulation never read the same folder, nor one inside the other's: its images
    would be counted (and weighted) twice (docs/security.md "A user's folder"). A deployment's sites
    may name the same path: each reads it on its own machine."""
    real = os.path.realpath(cp.site_data)
    for other, name in folders.items():
        if within(real, other) or within(other, real):
            raise PresetError(f"{preset.path}: sites {name!r} and {cp.name!r} read the same images "
                              f"({path_shown(other)} and {path_shown(real)}): each site's data folder is its "
                              f"own, or its images are counted twice")
    folders[real] = str(cp.name)


def site_id(preset: Preset, name: str) -> int:
    """A listed site's id: its position among the preset's ``[[sites]]`` (one server, one numbering).
    An open federation (no [[sites]]) has no such list: its server numbers names (``site_registry``)."""
    names = [s.name for s in preset.sites]
    if name not in names:
        raise PresetError(f"{preset.path}: no site named {name!r} in [[sites]] ({', '.join(names) or 'none listed'}); "
                          f"every site's name is listed there (its id is its place; `data` optional for a deployment)")
    return names.index(name)


def build_named_site(preset: Preset, name: str, folder: str | Path, eval_fraction: float | None = None,
                     number: int | None = None) -> Federation:
    """ONE site of a [federation] preset from its own folder (`fedmvp join --data DIR --name NAME`):
    `SiteFolderError` lists every problem of the folder; nothing of another site is read. Its id is its
    place among [[sites]], or in an open federation ``number``, the id the server gave its name (None:
    the join's check before it connects, where the id labels nothing that is sent)."""
    if is_open(preset):
        plan = plan_federation(preset, [name])[0]
        cp = replace(plan.clients[0], client_id=number or 0, seed=preset.seed + (number or 0))
    else:
        plan = plan_federation(preset)[0]
        cp = plan.clients[site_id(preset, name)]
    images = _site_images(preset, plan, Path(folder), eval_fraction)
    client, sets = _materialise(preset, plan, cp, images, site_attributes(preset, plan))
    return Federation([client], sets, preset.train.fraction_fit, preset.protocol, preset.seed, preset)
