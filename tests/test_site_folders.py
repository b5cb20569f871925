"""A federation by its class set: the preset keys, site folders (checked, split stably), one site
built alone equal to its part of the whole (issue 24)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from fedmvp.data.federation import SiteRequest, build_federation, build_site, load_federation  # noqa: E402
from fedmvp.data.federation_plan import plan_record  # noqa: E402
from fedmvp.data.site_folder import SiteFolderError, read_site_folder  # noqa: E402
from fedmvp.presets.schema import FederationSpec, PresetError, SiteSpec, load_preset  # noqa: E402
from fedmvp_formats.image_folder import held_out  # noqa: E402
from tests.site_trees import site_preset, world_classes  # noqa: E402

CLASSES = ["one", "two", "seven"]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    from fedmvp.synthetic.writer import write_world

    return write_world(tmp_path_factory.mktemp("world") / "world", counts={"train": 3, "test": 2},
                       domains=["photo", "painting"])


def png(path: Path, value: int = 0) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 4), (value, 0, 0)).save(path)
    return path


def test_every_new_key_has_help():
    from dataclasses import fields

    for cls in (FederationSpec, SiteSpec):
        assert all(f.metadata.get("help") for f in fields(cls) if not f.metadata.get("internal")), cls


def test_federation_keys_reach_what_they_control(tmp_path, world):
    seen, held = world_classes(world)
    path = site_preset(tmp_path, world, {"a": seen[:2] + held[:1], "b": seen[2:4]}, held[:1],
                       extra="shots = 1")
    text = path.read_text().replace('new_classes', 'eval_fraction = 0.5\nnew_classes')
    path.write_text(text)
    preset = load_preset(path)
    assert preset.protocol == "base-to-new" and preset.federation.eval_fraction == 0.5
    assert preset.federation.attributes_path() == tmp_path / "attributes.json"  # relative to the preset file
    assert [s.data_path() for s in preset.sites] == [tmp_path / "sites/a", tmp_path / "sites/b"]
    fed = build_federation(preset)
    a, b = fed.clients
    assert (a.name, b.name) == ("a", "b") and a.class_names == seen[:2] and b.class_names == seen[2:4]
    assert all(len([s for s in c.train if s[1] == y]) == 1 for c in (a, b) for y in (0, 1))  # shots = 1
    assert len([s for s in a.test if s[1] == 0]) == 3  # half of 5 images per class held out (ceil)
    new = next(e for e in fed.evaluations if e.kind == "new")
    assert new.domain == "a" and new.class_names == held[:1] and len(new.samples) == 5  # all, never trained
    trained = {p for c in fed.clients for p, _ in c.train}
    assert not any(p in trained for p, _ in new.samples)
    record = plan_record(preset)
    assert [c["name"] for c in record["clients"]] == ["a", "b"]
    assert {e["name"] for e in record["evaluations"]} == {"clinics/base/a", "clinics/new/a", "clinics/base/b",
                                                          "clinics/new/b"}


@pytest.mark.parametrize("text, problem", [
    ('[[datasets]]\nname = "x"\nlayout = "synthetic"\nroot = ""\n', "exclude each other"),
    ('[[sites]]\nname = "a"\n[[sites]]\nname = "a"\n', "used twice"),
    ('', r"eval_fraction must be in \(0, 1\)"),
])
def test_preset_mistakes_are_one_line(tmp_path, text, problem):
    (tmp_path / "attributes.json").write_text(json.dumps({c: ["x"] * 10 for c in CLASSES}))
    fraction = "1.5" if "eval_fraction" in problem else "0.2"
    path = tmp_path / "p.toml"
    path.write_text(f'[train]\nrounds = 1\n[federation]\nattributes = "attributes.json"\n'
                    f'eval_fraction = {fraction}\n{text}')
    with pytest.raises(PresetError, match=problem) as err:
        load_preset(path)
    assert "\n" not in str(err.value) and str(err.value).startswith(str(path))


def test_a_paper_preset_still_needs_its_protocol(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('[train]\nrounds = 1\n[[datasets]]\nname = "x"\nlayout = "synthetic"\nroot = ""\n')
    with pytest.raises(PresetError, match="missing key 'protocol'"):
        load_preset(path)


def _tree(root: Path, case: str) -> None:
    png(root / "one" / "a.png")
    if case == "unknown class":
        png(root / "eight" / "a.png")
    elif case == "empty folder":
        (root / "two").mkdir()
    elif case == "unreadable image":
        (root / "two").mkdir()
        (root / "two" / "broken.png").write_bytes(b"not a png")


@pytest.mark.parametrize("case, line", [
    ("unknown class", "eight: class 'eight' is not in the federation's class set"),
    ("empty folder", "two: empty class folder (no images)"),
    ("unreadable image", "two/broken.png: unreadable image"),
])
def test_site_folder_problems_are_each_one_line_naming_the_path(tmp_path, case, line):
    _tree(tmp_path, case)
    with pytest.raises(SiteFolderError) as err:
        read_site_folder(tmp_path, CLASSES, ["seven"], 0.2)
    path, _, reason = line.partition(": ")
    [problem] = err.value.problems  # one line, naming the path
    assert problem.startswith(f"{tmp_path / path}: {reason}") and "\n" not in problem


def test_split_is_stable_by_name_and_new_classes_are_evaluated_only(tmp_path):
    for i in range(10):  # distinct pictures: byte-identical files count once (site_folder)
        png(tmp_path / "one" / f"{i}.png", i)
        png(tmp_path / "seven" / f"{i}.png", 100 + i)
    first = read_site_folder(tmp_path, CLASSES, ["seven"], 0.2)
    again = read_site_folder(tmp_path, CLASSES, ["seven"], 0.2)
    assert first.train == again.train and first.test == again.test
    held = {f"one/{i}.png" for i in range(10)} & held_out([f"one/{i}.png" for i in range(10)], 0.2)
    assert {str(Path(p).relative_to(tmp_path)) for p, y in first.test if y == 0} == held and len(held) == 2
    assert {y for _, y in first.train} == {0} and len([1 for _, y in first.test if y == 2]) == 10
    assert first.counts == {"one": 10, "seven": 10}


def test_train_and_test_folders_are_used_when_both_exist(tmp_path):
    png(tmp_path / "train" / "one" / "a.png")
    png(tmp_path / "test" / "one" / "b.png", 1)
    site = read_site_folder(tmp_path, CLASSES, [], 0.2)
    assert [Path(p).name for p, _ in site.train] == ["a.png"] and [Path(p).name for p, _ in site.test] == ["b.png"]


def test_a_site_builds_only_its_own_part_with_the_same_shots(tmp_path, world):
    from tests.federated.conftest import write_preset

    preset = load_preset(write_preset(tmp_path, world))
    whole = build_federation(preset)
    for client in whole.clients:
        one = build_site(preset, client.client_id)
        assert [(c.train, c.test) for c in one.clients] == [(client.train, client.test)]
        for ev in one.evaluations:
            assert ev.samples == next(e for e in whole.evaluations if e.name == ev.name).samples
    listed = {p for c in build_site(preset, 1).clients for p, _ in c.train + c.test}
    assert not listed & {p for p, _ in whole.clients[0].train}


def test_a_named_site_reads_only_its_folder(tmp_path, world):
    seen, held = world_classes(world)
    path = site_preset(tmp_path, world, {"a": seen[:2], "b": seen[2:4]}, [])
    _, fed = load_federation(str(path), SiteRequest(name="b", data=str(tmp_path / "sites/b")))
    assert [(c.client_id, c.name, c.class_names) for c in fed.clients] == [(1, "b", seen[2:4])]
    _tree(tmp_path / "bad", "unknown class")
    with pytest.raises(SiteFolderError, match="eight"):
        load_federation(str(path), SiteRequest(name="a", data=str(tmp_path / "bad")))
    with pytest.raises(PresetError, match="no site named 'c'"):
        load_federation(str(path), SiteRequest(name="c", data=str(tmp_path / "sites/b")))


def test_a_server_without_the_data_records_the_same_class_set(tmp_path, world):
    """prepare_run of a [federation] preset writes RUN/classes.json from the attribute file alone, the
    same record a run prepared with every site's folder writes (so a served run exports without data)."""
    from fedmvp.federated.prepare import prepare_run

    seen, held = world_classes(world)
    path = site_preset(tmp_path, world, {"a": seen[:2] + held[:1], "b": seen[2:4]}, held[:1])
    served = prepare_run(str(path), str(tmp_path / "served"), None, False, "cpu", with_data=False)
    simulated = prepare_run(str(path), str(tmp_path / "simulated"), None, False, "cpu", with_data=True)
    record = json.loads((served.path / "classes.json").read_text())
    assert [c["name"] for c in record["classes"]] == seen[:4] + held[:1]  # base then new, the set's order
    assert record == json.loads((simulated.path / "classes.json").read_text())
    assert all(len(c["phrases"]) > 0 for c in record["classes"])
