"""build_federation on tiny trees: client label spaces, k-shot sets, evaluation sets per protocol."""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from data_trees import attributes, coop, corrupt, domainbed, fake_world, imagefolder  # noqa: E402

from fedmvp.data.dataset import UnreadableImageWarning  # noqa: E402
from fedmvp.data.federation import build_federation  # noqa: E402
from fedmvp.presets.schema import load_preset  # noqa: E402

HEAD = """
protocol = "{protocol}"
seed = 0
[train]
rounds = 1
shots = {shots}
fraction_fit = {fraction}
"""


def assert_plan_matches(fed) -> None:
    """The server's image-free plan (federation_plan) has the federation's exact shape."""
    from fedmvp.data.federation_plan import plan_record

    real, plan = fed.record(), plan_record(fed.preset)
    same = lambda rows, keys: [{k: r[k] for k in keys} for r in rows]  # noqa: E731
    keys = ("id", "name", "dataset", "domain", "classes")
    assert same(plan["clients"], keys) == same(real["clients"], keys)
    keys = ("name", "kind", "dataset", "domain", "classes")
    assert same(plan["evaluations"], keys) == same(real["evaluations"], keys)
    assert all(p["train_images"] >= r["train_images"] for p, r in zip(plan["clients"], real["clients"]))


def preset(tmp_path: Path, body: str, protocol: str = "base-to-new", shots: int = 2,
           fraction: float = 1.0):
    path = tmp_path / "p.toml"
    path.write_text(HEAD.format(protocol=protocol, shots=shots, fraction=fraction) + body)
    return load_preset(path)


def test_coop_base_to_new(tmp_path):
    names = [f"flower{i}" for i in range(6)]
    coop(tmp_path / "flowers", names, n_train=4, n_test=2)
    attributes(tmp_path / "flowers" / "a.json", names)
    body = """[[datasets]]
name = "OxfordFlowers"
layout = "coop"
root = "flowers"
split_file = "split_zhou_Test.json"
image_dir = "images"
attributes = "a.json"
classes_per_client = 1
"""
    fed = build_federation(preset(tmp_path, body))
    assert_plan_matches(fed)
    assert [c.name for c in fed.clients] == [f"OxfordFlowers/base-{j}" for j in range(3)]
    assert [c.class_names for c in fed.clients] == [["flower0"], ["flower1"], ["flower2"]]
    for c in fed.clients:
        assert c.client_id == fed.clients.index(c) and len(c.train) == 2 and len(c.test) == 2
        assert {y for _, y in c.train + c.test} == {0}
        assert all(Path(p).parent.name == c.class_names[0] for p, _ in c.train + c.test)
        assert c.style.suffix == "a type of flower, " and list(c.attributes) == c.class_names
    base, new = fed.evaluations
    assert (base.kind, base.class_names, new.kind, new.class_names) == ("base", names[:3], "new", names[3:])
    assert all(Path(p).parent.name == new.class_names[y] for p, y in new.samples) and len(new.samples) == 6
    again = build_federation(preset(tmp_path, body))
    assert [c.train for c in again.clients] == [c.train for c in fed.clients]


def test_domainbed_msst(tmp_path):
    domainbed(tmp_path / "PACS", ["art_painting", "photo", "sketch"], ["dog", "cat", "elk"], n=5)
    attributes(tmp_path / "PACS" / "attrs_sketch.json", ["cat", "dog", "elk"])
    for d in ("art_painting", "photo"):
        attributes(tmp_path / "PACS" / f"attrs_{d}.json", ["cat", "dog", "elk"])
    body = """[[datasets]]
name = "PACS"
layout = "domainbed"
root = "PACS"
attributes = "attrs_{domain}.json"
train_domains = ["art_painting", "photo"]
test_domains = ["sketch"]
"""
    fed = build_federation(preset(tmp_path, body, protocol="multi-source-single-target", shots=3))
    assert_plan_matches(fed)
    assert [c.name for c in fed.clients] == ["PACS/art_painting", "PACS/photo"]
    for c in fed.clients:
        assert c.class_names == ["cat", "dog", "elk"] and len(c.train) == 9 and len(c.test) == 3
        assert all(f"/{c.domain}/" in p for p, _ in c.train + c.test)
        assert not {p for p, _ in c.train} & {p for p, _ in c.test}
    assert fed.clients[0].style.prefix == "an art painting of a"
    (target,) = fed.evaluations
    assert (target.kind, target.domain, target.class_names, len(target.samples)) == \
        ("domain", "sketch", ["cat", "dog", "elk"], 15)
    assert target.style.prefix == "a sketch of a"


def test_ssmt_with_test_only_dataset(tmp_path):
    wnids = [f"n{i:02d}" for i in range(10)]
    imagefolder(tmp_path / "imagenet" / "train", wnids, n=3)
    imagefolder(tmp_path / "imagenet" / "val", wnids, n=1)
    imagefolder(tmp_path / "imagenet-r" / "imagenet-r", wnids[5:7], n=2)
    (tmp_path / "classnames.txt").write_text("".join(f"{w} class {w}\n" for w in wnids))
    attributes(tmp_path / "attrs.json", [f"class {w}" for w in wnids])
    body = f"""[[datasets]]
name = "ImageNet"
layout = "imagefolder"
root = "imagenet"
test_split = "val"
class_names_file = "{tmp_path}/classnames.txt"
attributes = "{tmp_path}/attrs.json"

[[datasets]]
name = "ImageNetR"
role = "test"
layout = "imagefolder"
root = "imagenet-r"
test_split = "imagenet-r"
class_names_file = "{tmp_path}/classnames.txt"
attributes = "{tmp_path}/attrs.json"
"""
    fed = build_federation(preset(tmp_path, body, protocol="ssmt", fraction=0.5))
    assert_plan_matches(fed)
    assert len(fed.clients) == 2 and [len(c.class_names) for c in fed.clients] == [5, 5]
    assert fed.clients[1].class_names[0] == "class n05" and fed.clients_per_round == 1
    base, r = fed.evaluations
    assert (base.kind, len(base.class_names), len(base.samples)) == ("base", 10, 10)
    assert (r.kind, r.dataset, r.class_names) == ("domain", "ImageNetR", ["class n05", "class n06"])
    assert sorted(y for _, y in r.samples) == [0, 0, 1, 1]


SYNTH = """[[datasets]]
name = "shapes"
layout = "synthetic"
root = "world"
train_domains = ["photo", "sketch"]
test_domains = ["painting"]
base_classes = 4
new_classes = 2
classes_per_client = 2
"""


def test_synthetic_clients_per_domain_and_evaluations(tmp_path):
    fake_world(tmp_path / "world", ["s0", "s1", "s2", "s3", "s4"], ["h0", "h1", "h2"],
               ["photo", "sketch", "painting"], {"train": 3, "test": 2})
    fed = build_federation(preset(tmp_path, SYNTH))
    assert_plan_matches(fed)
    assert [c.name for c in fed.clients] == ["shapes/photo/base-0", "shapes/photo/base-1",
                                             "shapes/sketch/base-0", "shapes/sketch/base-1"]
    assert fed.clients[3].class_names == ["s2", "s3"] and fed.clients[3].style.prefix == "a sketch of a"
    assert all(f"/{c.domain}/train/" in p for c in fed.clients for p, _ in c.train)
    kinds = [(e.kind, e.domain, e.class_names) for e in fed.evaluations]
    assert kinds == [("base", "photo", ["s0", "s1", "s2", "s3"]), ("new", "photo", ["h0", "h1"]),
                     ("base", "sketch", ["s0", "s1", "s2", "s3"]), ("new", "sketch", ["h0", "h1"]),
                     ("domain", "painting", ["s0", "s1", "s2", "s3", "h0", "h1"])]
    assert all(f"/{e.domain}/test/" in p for e in fed.evaluations for p, _ in e.samples)
    mixed = build_federation(preset(tmp_path, SYNTH + "mix_domains = true\n"))
    assert_plan_matches(mixed)
    assert [c.name for c in mixed.clients] == ["shapes/base-0", "shapes/base-1"]
    assert len(mixed.clients[0].train) == 2 * 2 * 2  # shots per class and domain
    assert mixed.clients[0].domain is None and mixed.clients[0].style.prefix == "a photo of a"


def test_dirichlet_label_skew_option(tmp_path):
    fake_world(tmp_path / "world", [f"s{i}" for i in range(6)], [], ["photo"], {"train": 4, "test": 1})
    body = SYNTH.replace('["photo", "sketch"]', '["photo"]').replace('test_domains = ["painting"]', "")
    body = body.replace("new_classes = 2", "new_classes = 0").replace("base_classes = 4", "")
    body = body.replace("classes_per_client = 2", "num_clients = 3\ndirichlet_alpha = 0.5")
    fed = build_federation(preset(tmp_path, body, shots=4))
    assert [c.name for c in fed.clients] == [f"shapes/photo/dir-{j}" for j in range(3)]
    assert sum(len(c.train) for c in fed.clients) == 24
    assert all(sorted({y for _, y in c.train}) == list(range(len(c.class_names))) for c in fed.clients)
    again = build_federation(preset(tmp_path, body, shots=4))
    assert [c.train for c in again.clients] == [c.train for c in fed.clients]


def test_unreadable_training_image_is_reported_once_and_replaced(tmp_path):
    fake_world(tmp_path / "world", ["s0", "s1", "s2", "s3"], ["h0", "h1"],
               ["photo", "sketch", "painting"], {"train": 3, "test": 1})
    bad = corrupt(tmp_path / "world" / "photo" / "train" / "s0" / "0001.png")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fed = build_federation(preset(tmp_path, SYNTH, shots=3))
        assert_plan_matches(fed)
        build_federation(preset(tmp_path, SYNTH, shots=3))
    reports = [str(w.message) for w in record if w.category is UnreadableImageWarning]
    assert len(reports) == 1 and bad in reports[0]
    assert all(p != bad for c in fed.clients for p, _ in c.train) and len(fed.clients[0].train) == 2 + 3


def test_shipped_demo_preset_builds_on_a_real_world(tmp_path):
    from fedmvp.synthetic.writer import write_world

    demo = Path(__file__).parents[1] / "fedmvp" / "presets" / "demo.toml"
    if not demo.exists():
        pytest.skip("demo.toml not written yet")
    root = write_world(tmp_path / "world", counts={"train": 1, "test": 1})
    path = tmp_path / "demo.toml"
    path.write_text(re.sub(r'(?m)^root = ""', f'root = "{root}"', demo.read_text()))
    fed = build_federation(load_preset(path))
    assert_plan_matches(fed)
    record = fed.record()
    assert len(record["clients"]) == len(fed.clients) >= 4
    assert "shapes/domain/painting" in [e["name"] for e in record["evaluations"]]
    assert {e.kind for e in fed.evaluations} == {"base", "new", "domain"}
    assert all(set(c.attributes) == set(c.class_names) and len(c.attributes[c.class_names[0]]) == 10
               for c in fed.clients)
