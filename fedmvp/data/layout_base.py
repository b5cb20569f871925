"""What a dataset layout answers, in one interface: the planner and the builder ask it, never its name.

Why: the questions a preset's dataset raises (are its fields right for the layout, where is its root,
what are its classes, its domains, its images per split) are asked of its layout object, never answered by
testing the layout's name, so a new layout is one class and one entry in the table of
``fedmvp/data/layout_table.py`` (``register_layout`` adds one from outside the package); the built-in
four are ``fedmvp/data/builtin_layouts.py``. Everything here is in the dataset's own label space.

``spec`` is a preset's ``DatasetSpec`` and ``preset`` its ``Preset`` (``fedmvp/presets/schema.py``); they
are not imported here because the schema imports the table to check a preset's ``layout``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedmvp.data.layouts import LabelledImages, LayoutError
from fedmvp.data.partitions import split_base_new

Sample = tuple[str, int]
Spec = Any  # fedmvp.presets.schema.DatasetSpec
PresetLike = Any  # fedmvp.presets.schema.Preset


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


def align(images: LabelledImages, names: list[str]) -> list[Sample]:
    """``images``' samples relabelled into ``names``' label space (matched by class name)."""
    if images.class_names == names:
        return images.samples
    label_of = {n: i for i, n in enumerate(names)}
    unknown = [n for n in images.class_names if n not in label_of]
    if unknown:
        raise LayoutError(f"classes not in the training class list: {', '.join(unknown[:5])}")
    return [(p, label_of[images.class_names[y]]) for p, y in images.samples]


def plan_from_names(preset: PresetLike, spec: Spec, names: list[str]) -> ClassPlan:
    """The class plan of a dataset whose label space is ``names``: a test dataset evaluates them all; a
    training one is cut into base and new by the protocol (``base_classes``, ``new_classes``)."""
    if spec.role == "test":
        return ClassPlan(names, list(range(len(names))), [])
    if preset.protocol == "base-to-new":
        base, new = split_base_new(len(names), spec.base_classes, spec.new_classes)
        return ClassPlan(names, base, new)
    if spec.base_classes is not None and spec.base_classes > len(names):
        raise ValueError(f"base_classes={spec.base_classes} but the data has {len(names)} classes")
    return ClassPlan(names, list(range(spec.base_classes or len(names))), [])


class Layout(ABC):
    """One way images are laid out on disk. Subclasses answer the abstract questions; the defaults suit
    a single-domain layout whose root is a folder the preset names."""

    multi_domain: bool = False  # train_domains/test_domains allowed: one pool (client set) per domain
    default_root: bool = False  # ``root = ""`` means a folder the layout makes itself
    default_attributes: str | None = None  # the attribute file when the preset names none (relative to root)

    def check(self, spec: Spec) -> str | None:
        """What is wrong with ``spec``'s layout-specific fields (one line, without the dataset's name), or
        None. Called when a preset is loaded, before any file is read."""
        return None

    def root(self, spec: Spec) -> Path:
        """The folder the dataset's files are read from (relative files resolve against it)."""
        return spec.root_path()

    @abstractmethod
    def class_names(self, spec: Spec) -> list[str]:
        """The label space of the split ``spec.role`` reads (train: ``train_split``), without listing images."""

    def class_plan(self, preset: PresetLike, spec: Spec) -> ClassPlan:
        """Which labels are trained (cut into clients) and which are evaluated as new."""
        return plan_from_names(preset, spec, self.class_names(spec))

    def pool_domains(self, spec: Spec) -> list[str | None]:
        """The source domains of a training dataset (one pool each)."""
        if self.multi_domain:
            return list(spec.train_domains or [spec.domain or "photo"])
        return [spec.domain]

    def eval_domains(self, spec: Spec) -> list[str | None]:
        """The domains a test dataset (``role = "test"``) is evaluated on, one set each."""
        if self.multi_domain:
            return list(spec.test_domains or [spec.domain or "photo"])
        return [spec.domain]

    @abstractmethod
    def pools(self, preset: PresetLike, spec: Spec, plan: ClassPlan, root: Path,
              domains: list[str | None] | None, labels: set[int] | None) -> list[Pool]:
        """Training and local-test images per source domain (``domains``, ``labels``: only these may be
        listed; the caller filters again, so listing more is only slower)."""

    @abstractmethod
    def test_images(self, spec: Spec, plan: ClassPlan, root: Path, domain: str | None) -> list[Sample]:
        """The evaluation images of a test dataset, or of a held-out domain (``kind = "domain"``), in
        ``plan``'s label space."""
