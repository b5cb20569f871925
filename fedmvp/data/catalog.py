"""What a preset's datasets hold: class plans, per-domain train/test pools, class-name queries.

Why separate from the federation: ``preset_class_names`` (attribute generation) needs a dataset's
class list without listing a single image, and the partition code should not care which layout
the images came from. Everything here is in the dataset's own label space. The preset module
itself stays schema + parsing; every question about a preset's *data* is answered here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fedmvp.data.layouts import (LabelledImages, LayoutError, domainbed_classes, imagefolder_classes,
                                 read_coop_split, read_domainbed, read_imagefolder, read_synthetic,
                                 read_world_meta)
from fedmvp.data.partitions import split_base_new
from fedmvp.data.sampling import holdout_split
from fedmvp.presets.schema import DatasetSpec, Preset, PresetError, load_preset

Sample = tuple[str, int]


@dataclass
class ClassPlan:
    """Which of a dataset's labels are cut into clients and which are only evaluated as new."""

    class_names: list[str]  # the data's full label space
    trained: list[int]  # labels cut into clients (base)
    new: list[int]  # labels only evaluated (new)

    @property
    def used(self) -> list[int]:
        return self.trained + self.new


@dataclass
class Pool:
    """Training and local-test images of one source domain, in the dataset's label space."""

    domain: str | None
    train: list[Sample]
    test: list[Sample]


def world_root(spec: DatasetSpec) -> Path:
    """The synthetic world's folder; ``root = ""`` renders (once, cached) the default world."""
    if spec.synthetic_default:
        from fedmvp.synthetic.writer import ensure_world

        return Path(ensure_world(seed=spec.world_seed))
    return spec.root_path()


def world_table(spec: DatasetSpec) -> list[tuple[str, bool]]:
    """(name, held_out) in label order; the default world's list needs no rendering."""
    if spec.synthetic_default:
        from fedmvp.synthetic.world import load_classes

        return [(c.name, c.held_out) for c in load_classes()]
    return [(c["name"], bool(c.get("held_out"))) for c in read_world_meta(spec.root_path())["classes"]]


def names_file(spec: DatasetSpec) -> Path | None:
    """The resolved ``class_names_file`` (imagefolder), if any."""
    return spec.file_path(spec.class_names_file) if spec.class_names_file else None


def test_folder(spec: DatasetSpec) -> Path:
    """Where test images are: ``root/test_split``, or the root itself for ``test_split = ""``."""
    return spec.file_path(spec.test_split) if spec.test_split else spec.root_path()


def class_plan(preset: Preset, spec: DatasetSpec) -> ClassPlan:
    """Which labels are trained (cut into clients) and which are evaluated as new."""
    if spec.layout == "synthetic":
        table = world_table(spec)
        names = [n for n, _ in table]
        seen = [i for i, (_, held) in enumerate(table) if not held]
        held = [i for i, (_, h) in enumerate(table) if h]
        nb = len(seen) if spec.base_classes is None else spec.base_classes
        nn = len(held) if spec.new_classes is None else spec.new_classes
        if nb > len(seen) or nn > len(held):
            raise ValueError(f"the world has {len(seen)} seen and {len(held)} held-out classes; "
                             f"base_classes={nb}, new_classes={nn}")
        if spec.role == "test":
            return ClassPlan(names, seen[:nb] + held[:nn], [])
        base, new = seen[:nb], held[:nn]
        if preset.protocol == "base-to-new":
            return ClassPlan(names, base, new)
        return ClassPlan(names, base + new, [])
    if spec.layout == "imagefolder":
        folder = spec.file_path(spec.train_split) if spec.role == "train" else test_folder(spec)
        names = imagefolder_classes(folder, names_file(spec))[1]
    elif spec.layout == "coop":
        names = read_coop_split(spec.file_path(spec.split_file), spec.root_path(),
                                spec.train_split if spec.role == "train" else spec.test_split).class_names
    else:
        names = domainbed_classes(spec.root_path())
    if spec.role == "test":
        return ClassPlan(names, list(range(len(names))), [])
    if preset.protocol == "base-to-new":
        base, new = split_base_new(len(names), spec.base_classes, spec.new_classes)
        return ClassPlan(names, base, new)
    if spec.base_classes is not None and spec.base_classes > len(names):
        raise ValueError(f"base_classes={spec.base_classes} but the data has {len(names)} classes")
    return ClassPlan(names, list(range(spec.base_classes or len(names))), [])


def dataset_class_names(preset: Preset, spec: DatasetSpec) -> list[str]:
    """The class names a dataset of ``preset`` uses (trained + new), without listing images."""
    try:
        plan = class_plan(preset, spec)
    except (LayoutError, ValueError, OSError) as exc:
        raise preset_failure(preset, spec, exc) from None
    return [plan.class_names[y] for y in plan.used]


def align(images: LabelledImages, names: list[str]) -> list[Sample]:
    """``images``' samples relabelled into ``names``' label space (matched by class name)."""
    if images.class_names == names:
        return images.samples
    label_of = {n: i for i, n in enumerate(names)}
    unknown = [n for n in images.class_names if n not in label_of]
    if unknown:
        raise LayoutError(f"classes not in the training class list: {', '.join(unknown[:5])}")
    return [(p, label_of[images.class_names[y]]) for p, y in images.samples]


def domain_images(spec: DatasetSpec, root: Path, domain: str) -> list[Sample]:
    """A held-out domain's test images (all of a DomainBed domain)."""
    if spec.layout == "synthetic":
        return read_synthetic(root, domain, spec.test_split).samples
    return read_domainbed(root, domain).samples


def source_pools(preset: Preset, spec: DatasetSpec, plan: ClassPlan, root: Path,
                 domains: list[str | None] | None = None, labels: set[int] | None = None) -> list[Pool]:
    """Training and local-test images per source domain, in the dataset's label space; ``domains`` and
    ``labels`` keep only those (one site's pools: a synthetic world then lists only its class folders).
    Every split below is per class, so a site's images are the same listed alone or among all."""
    pools = _source_pools(preset, spec, plan, root, domains, labels)
    if domains is not None:
        pools = [p for p in pools if p.domain in domains]
    if labels is not None:
        pools = [Pool(p.domain, [s for s in p.train if s[1] in labels], [s for s in p.test if s[1] in labels])
                 for p in pools]
    return pools


def _source_pools(preset: Preset, spec: DatasetSpec, plan: ClassPlan, root: Path,
                  domains: list[str | None] | None, labels: set[int] | None) -> list[Pool]:
    if spec.layout == "imagefolder":
        classes = names_file(spec)
        train = align(read_imagefolder(spec.file_path(spec.train_split), classes), plan.class_names)
        test = align(read_imagefolder(test_folder(spec), classes), plan.class_names)
        return [Pool(spec.domain, train, test)]
    if spec.layout == "coop":
        split, images = spec.file_path(spec.split_file), spec.file_path(spec.image_dir)
        return [Pool(spec.domain, read_coop_split(split, images, spec.train_split).samples,
                      read_coop_split(split, images, spec.test_split).samples)]
    pools = []
    only = None if labels is None else {plan.class_names[y] for y in labels}
    for domain in spec.train_domains or [spec.domain or "photo"]:
        if domains is not None and domain not in domains:
            continue
        if spec.layout == "synthetic":
            pools.append(Pool(domain, read_synthetic(root, domain, spec.train_split, only).samples,
                               read_synthetic(root, domain, spec.test_split, only).samples))
        else:
            rest, held = holdout_split(read_domainbed(root, domain).samples, spec.holdout_fraction,
                                       preset.seed)
            pools.append(Pool(domain, rest, held))
    return pools


def preset_failure(preset: Preset, spec: DatasetSpec, exc: BaseException) -> PresetError:
    """``exc`` as the one-line ``PresetError`` naming the preset file and the dataset."""
    if isinstance(exc, PresetError):
        return exc
    index = preset.datasets.index(spec) if spec in preset.datasets else "?"
    message = " ".join(str(exc).split()) or type(exc).__name__
    return PresetError(f"{preset.path}: datasets[{index}] ({spec.name}): {message}")


def preset_class_names(name_or_path: str | os.PathLike) -> list[str]:
    """Every class name the preset uses, over all datasets, first occurrence first (for
    ``fedmvp attributes generate``). Reads class lists only, never images."""
    preset = name_or_path if isinstance(name_or_path, Preset) else load_preset(name_or_path)
    names: dict[str, None] = {}
    for spec in preset.datasets:
        names.update(dict.fromkeys(dataset_class_names(preset, spec)))
    return list(names)


def preset_domains(name_or_path: str | os.PathLike) -> list[str]:
    """Every domain the preset names (train, test and single-dataset domains), in order."""
    preset = name_or_path if isinstance(name_or_path, Preset) else load_preset(name_or_path,
                                                                               check_roots=False)
    domains: dict[str, None] = {}
    for d in preset.datasets:
        domains.update(dict.fromkeys([*d.train_domains, *d.test_domains, *([d.domain] if d.domain else [])]))
    return list(domains)
