"""A dataset layout registered from outside the package trains and evaluates through the normal path.

The recipe of docs/architecture.md ("How to add ...", "A dataset layout") followed by a test: a layout
reading a flat CSV (``path,label,split``) is one class and one ``register_layout`` call; the preset names
it, the planner and the builder ask it, and a site's local training and the evaluation run over it.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent / "edge_client"))
from edge_helpers import CLASSES, class_image, pretrained_tag  # noqa: E402

from fedmvp.data.layout_base import ClassPlan, Layout, Pool, align  # noqa: E402
from fedmvp.data.layout_table import layout_names, register_layout, unregister_layout  # noqa: E402
from fedmvp.data.layouts import LabelledImages, LayoutError  # noqa: E402
from fedmvp.presets.schema import PresetError, load_preset  # noqa: E402


class CsvLayout(Layout):
    """``ROOT/labels.csv``: one ``path,label,split`` row an image (paths relative to ROOT); labels in the
    order they first appear."""

    def rows(self, spec) -> list[tuple[str, str, str]]:
        path = spec.root_path() / "labels.csv"
        try:
            with path.open(newline="", encoding="utf-8") as handle:
                return [(str(spec.root_path() / r["path"]), r["label"], r["split"]) for r in csv.DictReader(handle)]
        except (OSError, KeyError) as exc:
            raise LayoutError(f"{path}: not a path,label,split table ({exc})") from None

    def split(self, spec, split: str) -> LabelledImages:
        names = self.class_names(spec)
        return LabelledImages([(p, names.index(label)) for p, label, s in self.rows(spec) if s == split], names)

    def class_names(self, spec) -> list[str]:
        return list(dict.fromkeys(label for _, label, _ in self.rows(spec)))

    def pools(self, preset, spec, plan: ClassPlan, root: Path, domains, labels) -> list[Pool]:
        return [Pool(spec.domain, align(self.split(spec, spec.train_split), plan.class_names),
                     align(self.split(spec, spec.test_split), plan.class_names))]

    def test_images(self, spec, plan: ClassPlan, root: Path, domain) -> list[tuple[str, int]]:
        return align(self.split(spec, spec.test_split), plan.class_names)


@pytest.fixture
def csv_layout():
    register_layout("csvtable", CsvLayout())
    yield
    unregister_layout("csvtable")


def write_csv_dataset(root: Path, per_class: int = 4) -> None:
    """Images of the edge tests' six classes in one flat folder, listed in labels.csv, and attributes."""
    rng = np.random.default_rng(0)
    (root / "img").mkdir(parents=True)
    rows = []
    for split in ("train", "test"):
        for ci, name in enumerate(CLASSES):
            for i in range(per_class):
                file = f"img/{split}-{name}-{i}.png"
                class_image(ci, rng).save(root / file)
                rows.append({"path": file, "label": name, "split": split})
    with (root / "labels.csv").open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, ["path", "label", "split"])
        writer.writeheader()
        writer.writerows(rows)
    attrs = {c: [f"{c.split('_')[0]} colour", f"a {c.split('_')[1]} outline", "a flat surface"] for c in CLASSES}
    (root / "attributes.json").write_text(json.dumps(attrs))


def write_preset(path: Path, root: Path, layout: str = "csvtable", extra: str = "") -> Path:
    path.write_text(f"""
name = "csvtest"
protocol = "base-to-new"
seed = 0
[model]
clip = "fedmvp-tiny"
pretrained = "{pretrained_tag()}"
[train]
rounds = 1
batch_size = 8
shots = 2
num_attributes = 3
[[datasets]]
name = "shapes"
layout = "{layout}"
root = "{root}"
attributes = "attributes.json"
classes_per_client = 3
{extra}""")
    return path


def test_a_registered_layout_trains_and_evaluates_through_the_normal_path(csv_layout, tmp_path):
    import torch

    from fedmvp.data.federation_plan import plan_record
    from fedmvp.federated.evaluation import evaluate_global
    from fedmvp.federated.task import LocalSettings, local_train, task_context
    from fedmvp.model import FedMVPConfig

    write_csv_dataset(tmp_path / "data")
    path = write_preset(tmp_path / "csv.toml", tmp_path / "data")
    preset = load_preset(path)
    plan = plan_record(preset)  # the server's image-free plan asks the layout for class lists
    assert [c["classes"] for c in plan["clients"]] == [CLASSES[:3]]
    assert [e["name"] for e in plan["evaluations"]] == ["shapes/base", "shapes/new"]

    ctx = task_context(str(path), FedMVPConfig(lora_rank=4))
    fed = ctx.federation
    assert [len(c.train) for c in fed.clients] == [2 * 3]  # shots x classes, drawn from the CSV's train rows
    assert {Path(p).name.split("-")[0] for c in fed.clients for p, _ in c.train} == {"train"}
    assert {e.name: len(e.samples) for e in fed.evaluations} == {"shapes/base": 12, "shapes/new": 12}
    state = ctx.model.state("all")
    before = evaluate_global(ctx, state)
    result = local_train(ctx, fed.clients[0], state, 1, 0.01, False,
                         LocalSettings(local_epochs=1, batch_size=8, momentum=0.9, weight_decay=1e-5, sigma=0.5))
    assert result.num_examples == 6 and np.isfinite(result.loss)
    assert any(not torch.equal(v, state[k]) for k, v in result.state.items())  # it trained
    after = evaluate_global(ctx, {**state, **result.state})
    assert set(before) == set(after) and after["base"] is not None and after["new"] is not None


def test_preset_validation_names_the_registered_layouts(csv_layout, tmp_path):
    (tmp_path / "data").mkdir()
    with pytest.raises(PresetError) as caught:
        load_preset(write_preset(tmp_path / "p.toml", tmp_path / "data", layout="parquet"))
    line = str(caught.value)
    assert "\n" not in line and "unknown layout 'parquet'" in line
    assert all(name in line for name in ("imagefolder", "coop", "domainbed", "synthetic", "csvtable"))
    assert layout_names()[-1] == "csvtable"


def test_the_shared_rules_hold_for_a_registered_layout(csv_layout, tmp_path):
    """A single-domain layout refuses train_domains with the multi-domain layouts named, like the built-ins."""
    (tmp_path / "data").mkdir()
    with pytest.raises(PresetError, match="train_domains/test_domains need the domainbed or synthetic layout"):
        load_preset(write_preset(tmp_path / "p.toml", tmp_path / "data", extra='train_domains = ["a"]\n'))


def test_a_taken_name_is_refused_and_an_unregistered_one_is_gone(csv_layout, tmp_path):
    with pytest.raises(ValueError, match="registered already"):
        register_layout("coop", CsvLayout())
    with pytest.raises(TypeError):
        register_layout("plain", object())  # type: ignore[arg-type]
    unregister_layout("csvtable")
    assert "csvtable" not in layout_names()
    with pytest.raises(PresetError, match="unknown layout 'csvtable'"):
        (tmp_path / "data").mkdir()
        load_preset(write_preset(tmp_path / "p.toml", tmp_path / "data"))
