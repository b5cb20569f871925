"""The four layouts fedmvp reads (imagefolder, coop, domainbed, synthetic) as `Layout` objects.

Why here: each one's rules (its fields, its root, its classes, its images per split) in one class, the
readers of ``fedmvp/data/layouts.py`` under them; ``fedmvp/data/layout_table.py`` names them.
"""

from __future__ import annotations

from pathlib import Path

from fedmvp.data.layout_base import ClassPlan, Layout, Pool, PresetLike, Sample, Spec, align
from fedmvp.data.layouts import (domainbed_classes, imagefolder_classes, read_coop_split, read_domainbed,
                                 read_imagefolder, read_synthetic, read_world_meta)
from fedmvp.data.sampling import holdout_split


def names_file(spec: Spec) -> Path | None:
    """The resolved ``class_names_file`` (imagefolder), if any."""
    return spec.file_path(spec.class_names_file) if spec.class_names_file else None


def test_folder(spec: Spec) -> Path:
    """Where test images are: ``root/test_split``, or the root itself for ``test_split = ""``."""
    return spec.file_path(spec.test_split) if spec.test_split else spec.root_path()


class ImageFolderLayout(Layout):
    """``ROOT/<split>/<class>/*``: labels = sorted class folders, or ``class_names_file``'s order."""

    def class_names(self, spec: Spec) -> list[str]:
        folder = spec.file_path(spec.train_split) if spec.role == "train" else test_folder(spec)
        return imagefolder_classes(folder, names_file(spec))[1]

    def pools(self, preset: PresetLike, spec: Spec, plan: ClassPlan, root: Path,
              domains: list[str | None] | None, labels: set[int] | None) -> list[Pool]:
        classes = names_file(spec)
        train = align(read_imagefolder(spec.file_path(spec.train_split), classes), plan.class_names)
        test = align(read_imagefolder(test_folder(spec), classes), plan.class_names)
        return [Pool(spec.domain, train, test)]

    def test_images(self, spec: Spec, plan: ClassPlan, root: Path, domain: str | None) -> list[Sample]:
        return align(read_imagefolder(test_folder(spec), names_file(spec)), plan.class_names)


class CoopLayout(Layout):
    """CoOp's ``split_zhou_<Dataset>.json`` (``split_file``) over ``image_dir``."""

    def check(self, spec: Spec) -> str | None:
        return None if spec.split_file else f"the coop layout needs split_file (e.g. split_zhou_{spec.name}.json)"

    def class_names(self, spec: Spec) -> list[str]:
        return read_coop_split(spec.file_path(spec.split_file), spec.root_path(),
                               spec.train_split if spec.role == "train" else spec.test_split).class_names

    def pools(self, preset: PresetLike, spec: Spec, plan: ClassPlan, root: Path,
              domains: list[str | None] | None, labels: set[int] | None) -> list[Pool]:
        split, images = spec.file_path(spec.split_file), spec.file_path(spec.image_dir)
        return [Pool(spec.domain, read_coop_split(split, images, spec.train_split).samples,
                     read_coop_split(split, images, spec.test_split).samples)]

    def test_images(self, spec: Spec, plan: ClassPlan, root: Path, domain: str | None) -> list[Sample]:
        return read_coop_split(spec.file_path(spec.split_file), spec.file_path(spec.image_dir),
                               spec.test_split).samples


class DomainBedLayout(Layout):
    """``ROOT/<domain>/<class>/*``: every domain shares the sorted class folders; no test split, so a
    share of each source domain (``holdout_fraction``) is its local test set."""

    multi_domain = True

    def check(self, spec: Spec) -> str | None:
        if not (spec.train_domains if spec.role == "train" else spec.test_domains):
            return f"the domainbed layout needs {'train_domains' if spec.role == 'train' else 'test_domains'}"
        return None

    def class_names(self, spec: Spec) -> list[str]:
        return domainbed_classes(spec.root_path())

    def pools(self, preset: PresetLike, spec: Spec, plan: ClassPlan, root: Path,
              domains: list[str | None] | None, labels: set[int] | None) -> list[Pool]:
        pools = []
        for domain in self.pool_domains(spec):
            if domains is not None and domain not in domains:
                continue
            rest, held = holdout_split(read_domainbed(root, domain).samples, spec.holdout_fraction, preset.seed)
            pools.append(Pool(domain, rest, held))
        return pools

    def test_images(self, spec: Spec, plan: ClassPlan, root: Path, domain: str | None) -> list[Sample]:
        return read_domainbed(root, domain).samples


class SyntheticLayout(Layout):
    """The offline stand-in world ``ROOT/<domain>/<split>/<class>/*`` with ``world.json`` (labels, which
    classes are held out) and ``attributes.json``; ``root = ""`` renders the default world once."""

    multi_domain = True
    default_root = True
    default_attributes = "attributes.json"

    def root(self, spec: Spec) -> Path:
        if not spec.root.strip():
            from fedmvp.synthetic.writer import ensure_world

            return Path(ensure_world(seed=spec.world_seed))
        return spec.root_path()

    def table(self, spec: Spec) -> list[tuple[str, bool]]:
        """(name, held_out) in label order; the default world's list needs no rendering."""
        if not spec.root.strip():
            from fedmvp.synthetic.world import load_classes

            return [(c.name, c.held_out) for c in load_classes()]
        return [(c["name"], bool(c.get("held_out"))) for c in read_world_meta(spec.root_path())["classes"]]

    def class_names(self, spec: Spec) -> list[str]:
        return [n for n, _ in self.table(spec)]

    def class_plan(self, preset: PresetLike, spec: Spec) -> ClassPlan:
        """Base classes are the world's first seen ones, new its first held-out ones."""
        table = self.table(spec)
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

    def pools(self, preset: PresetLike, spec: Spec, plan: ClassPlan, root: Path,
              domains: list[str | None] | None, labels: set[int] | None) -> list[Pool]:
        only = None if labels is None else {plan.class_names[y] for y in labels}
        return [Pool(domain, read_synthetic(root, domain, spec.train_split, only).samples,
                     read_synthetic(root, domain, spec.test_split, only).samples)
                for domain in self.pool_domains(spec) if domains is None or domain in domains]

    def test_images(self, spec: Spec, plan: ClassPlan, root: Path, domain: str | None) -> list[Sample]:
        return read_synthetic(root, domain, spec.test_split).samples
