"""What a preset's datasets hold: class plans, per-domain train/test pools, class-name queries.

Why separate from the federation: ``preset_class_names`` (attribute generation) needs a dataset's
class list without listing a single image, and the partition code should not care which layout
the images came from. Everything here is in the dataset's own label space. The preset module
itself stays schema + parsing; every question about a preset's *data* is answered here, each by the
dataset's layout (``fedmvp/data/layout_table.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

from fedmvp.data.layout_base import ClassPlan, Pool, Sample, align
from fedmvp.data.layout_table import layout_of
from fedmvp.data.layouts import LayoutError
from fedmvp.presets.schema import DatasetSpec, Preset, PresetError, load_preset

__all__ = ["ClassPlan", "Pool", "Sample", "align", "class_plan", "dataset_class_names", "dataset_root",
           "preset_class_names", "preset_domains", "preset_failure", "source_pools", "test_images"]


def dataset_root(spec: DatasetSpec) -> Path:
    """The folder the dataset's files are read from (the synthetic default world: rendered once, cached)."""
    return layout_of(spec.layout).root(spec)


def class_plan(preset: Preset, spec: DatasetSpec) -> ClassPlan:
    """Which labels are trained (cut into clients) and which are evaluated as new."""
    return layout_of(spec.layout).class_plan(preset, spec)


def dataset_class_names(preset: Preset, spec: DatasetSpec) -> list[str]:
    """The class names a dataset of ``preset`` uses (trained + new), without listing images."""
    try:
        plan = class_plan(preset, spec)
    except (LayoutError, ValueError, OSError) as exc:
        raise preset_failure(preset, spec, exc) from None
    return [plan.class_names[y] for y in plan.used]


def test_images(spec: DatasetSpec, plan: ClassPlan, root: Path, domain: str | None) -> list[Sample]:
    """A test dataset's images, or a held-out domain's (all of a DomainBed domain)."""
    return layout_of(spec.layout).test_images(spec, plan, root, domain)


def source_pools(preset: Preset, spec: DatasetSpec, plan: ClassPlan, root: Path,
                 domains: list[str | None] | None = None, labels: set[int] | None = None) -> list[Pool]:
    """Training and local-test images per source domain, in the dataset's label space; ``domains`` and
    ``labels`` keep only those (one site's pools: a synthetic world then lists only its class folders).
    Every split below is per class, so a site's images are the same listed alone or among all."""
    pools = layout_of(spec.layout).pools(preset, spec, plan, root, domains, labels)
    if domains is not None:
        pools = [p for p in pools if p.domain in domains]
    if labels is not None:
        pools = [Pool(p.domain, [s for s in p.train if s[1] in labels], [s for s in p.test if s[1] in labels])
                 for p in pools]
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
