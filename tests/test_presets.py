"""Preset files: the shipped ones parse; every bad preset stops with one line naming the file."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from data_trees import attributes, imagefolder  # noqa: E402

from fedmvp.data.federation import build_federation  # noqa: E402
from fedmvp.data.catalog import preset_class_names, preset_domains  # noqa: E402
from fedmvp.presets.schema import (DatasetSpec, ModelSpec, Preset, PresetError, TrainSpec,  # noqa: E402
                                   list_presets, load_preset)

CLASSES = ["ant", "bee", "cat", "dog", "eel", "fox"]

GOOD = """
name = "tiny"
protocol = "base-to-new"
seed = 1
[model]
clip = "fedmvp-tiny"
pretrained = "synthetic"
[train]
rounds = 2
shots = 2
[[datasets]]
name = "animals"
layout = "imagefolder"
root = "data"
attributes = "attrs.json"
classes_per_client = 2
"""


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    imagefolder(tmp_path / "data" / "train", CLASSES, n=3)
    imagefolder(tmp_path / "data" / "test", CLASSES, n=2)
    attributes(tmp_path / "data" / "attrs.json", CLASSES)
    return tmp_path


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "preset.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", list_presets())
def test_shipped_presets_parse(name):
    preset = load_preset(name, check_roots=False)
    assert preset.name == name and preset.path == Path(__file__).parents[1] / "fedmvp" / "presets" / f"{name}.toml"
    assert preset.datasets and preset.train.rounds >= 1


def test_shipped_presets_have_the_papers_shape():
    assert {"base2new", "domainbed-pacs", "imagenet-ssmt"} <= set(list_presets())
    b2n = load_preset("base2new", check_roots=False)
    assert [d.name for d in b2n.datasets] == ["Caltech101", "OxfordFlowers", "FGVCAircraft", "UCF101",
                                             "OxfordPets", "Food101", "DTD", "StanfordCars", "SUN397"]
    assert all(d.layout == "coop" and d.root.startswith("${FEDMVP_DATA}") for d in b2n.datasets)
    pacs = load_preset("domainbed-pacs", check_roots=False)
    assert pacs.protocol == "msst" and pacs.datasets[0].test_domains == ["sketch"]
    assert "sketch" in preset_domains("domainbed-pacs")
    ssmt = load_preset("imagenet-ssmt", check_roots=False)
    assert ssmt.protocol == "ssmt" and ssmt.train.fraction_fit == 0.1
    assert ssmt.datasets[0].classes_per_client == 5 and [d.role for d in ssmt.datasets][1:] == ["test"] * 4


def test_demo_preset_keys_are_valid(tmp_path):
    demo = """
name = "demo"
protocol = "base-to-new"
seed = 0
[model]
clip = "fedmvp-tiny"
pretrained = "synthetic"
[train]
rounds = 10
local_epochs = 1
batch_size = 32
shots = 8
[[datasets]]
name = "shapes"
layout = "synthetic"
root = ""
attributes = "attributes.json"
train_domains = ["photo", "sketch"]
test_domains = ["painting"]
base_classes = 24
new_classes = 16
classes_per_client = 6
"""
    preset = load_preset(write(tmp_path, demo))
    assert preset.datasets[0].synthetic_default and preset.train.lr == 0.003
    assert len(preset_class_names(preset)) == 40  # from the class list: nothing is rendered


def test_every_field_has_help():
    for cls in (ModelSpec, TrainSpec, DatasetSpec, Preset):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help") or f.metadata.get("internal"), f"{cls.__name__}.{f.name}"


METHOD_VALUES = {"alpha": 2.5, "num_prompts": 3, "use_lora": False, "lora_rank": 2}  # none is the default


def test_every_method_key_of_the_preset_reaches_the_model(tree):
    """Each [train] key the schema marks as a method field becomes the method record the model is built as."""
    from fedmvp.federated.prepare import method_config
    from fedmvp.presets.schema import method_keys
    from fedmvp_formats.method import method_field

    assert set(method_keys()) == set(METHOD_VALUES)  # a new method key needs a value here
    for key, value in METHOD_VALUES.items():
        assert method_field(key).default != value
        text = GOOD.replace("shots = 2", f"shots = 2\n{key} = {str(value).lower()}")
        config = method_config(load_preset(write(tree, text)).train)
        assert getattr(config, method_keys()[key]) == value and config.to_dict()[key] == value, key
    default = method_config(load_preset(write(tree, GOOD)).train)
    assert default.to_dict() == type(default)().to_dict()  # left out: the record's documented defaults


def test_method_keys_take_help_and_ranges_from_the_method_record(tree):
    from fedmvp_formats.method import method_field

    for f in dataclasses.fields(TrainSpec):
        if "method" in f.metadata:
            assert f.metadata["help"] == method_field(f.metadata["method"]).metadata["help"]
    for edit, says in (("lora_rank = 0", "[train]: lora_rank must be at least 1, got 0"),
                       ("alpha = -1.0", "[train]: alpha must be 0.0 or more, got -1.0"),
                       ("num_prompts = 0", "[train]: num_prompts must be at least 1, got 0")):
        with pytest.raises(PresetError) as info:
            load_preset(write(tree, GOOD.replace("shots = 2", f"shots = 2\n{edit}")))
        assert says in str(info.value) and "\n" not in str(info.value)


def test_good_preset_loads_with_paths_relative_to_the_file(tree):
    preset = load_preset(write(tree, GOOD))
    assert preset.datasets[0].root_path() == tree / "data"
    assert preset_class_names(preset) == CLASSES


def test_roots_expand_variables_and_report_unset_ones(tree, monkeypatch):
    path = write(tree, GOOD.replace('root = "data"', 'root = "${MY_DATA}/data"'))
    monkeypatch.setenv("MY_DATA", str(tree))
    assert load_preset(path).datasets[0].root_path() == tree / "data"
    monkeypatch.delenv("MY_DATA")
    with pytest.raises(PresetError, match="MY_DATA is not set"):
        load_preset(path)
    assert load_preset(path, check_roots=False).datasets[0].root == "${MY_DATA}/data"


BAD = [
    ("unknown top-level key", ("seed = 1", "seed = 1\nrouds = 3"), "unknown key 'rouds' (allowed: name,"),
    ("unknown train key", ("shots = 2", "shots = 2\nlrr = 0.1"), "[train]: unknown key 'lrr' (allowed: rounds,"),
    ("unknown model key", ('clip = "fedmvp-tiny"', 'clip = "fedmvp-tiny"\nweights = "x"'), "[model]: unknown key"),
    ("unknown dataset key", ("classes_per_client = 2", "classes_per_clinet = 2"),
     "datasets[0] (animals): unknown key 'classes_per_clinet' (allowed: name, layout, root,"),
    ("missing root", ('root = "data"', 'root = "nowhere"'), "root {tmp}/nowhere does not exist"),
    ("unknown protocol", ('protocol = "base-to-new"', 'protocol = "base-to-old"'), "unknown protocol 'base-to-old'"),
    ("unknown layout", ('layout = "imagefolder"', 'layout = "folders"'), "unknown layout 'folders'"),
    ("wrong type", ("rounds = 2", 'rounds = "two"'), "[train]: rounds must be an integer, got 'two'"),
    ("missing key", ("rounds = 2", ""), "[train]: missing key 'rounds'"),
    ("bad range", ("shots = 2", "shots = 2\nfraction_fit = 1.5"), "fraction_fit must be in (0, 1]"),
    ("coop without split file", ('layout = "imagefolder"', 'layout = "coop"'), "needs split_file"),
    ("dirichlet without clients", ("classes_per_client = 2", "dirichlet_alpha = 0.5"), "needs num_clients"),
    ("invalid toml", ("seed = 1", "seed = = 1"), "invalid TOML"),
    ("no datasets", ("[[datasets]]", "[[other]]"), "unknown key 'other'"),
]


@pytest.mark.parametrize("case, edit, message", BAD, ids=[b[0] for b in BAD])
def test_bad_preset_is_one_line_starting_with_the_path(tree, case, edit, message):
    path = write(tree, GOOD.replace(*edit, 1))
    with pytest.raises(PresetError) as info:
        load_preset(path)
    text = str(info.value)
    assert text.startswith(f"{path}: ") and "\n" not in text
    assert message.format(tmp=tree) in text


@pytest.mark.parametrize("case, edit, message", [
    ("too few clients", ("classes_per_client = 2", "classes_per_client = 1\nnum_clients = 2"),
     "1 classes are in no client: cat"),
    ("explicit clients", ("classes_per_client = 2", 'clients = [["ant"], ["cat"]]'),
     "1 classes are in no client: bee"),
    ("class without images", None, "1 classes are in no client (no readable training images): bee"),
    ("attributes missing", ('attributes = "attrs.json"', 'attributes = "none.json"'), "no such attribute file"),
])
def test_bad_partition_stops_before_training(tree, case, edit, message):
    if edit is None:
        for image in (tree / "data" / "train" / "bee").iterdir():
            image.unlink()
    path = write(tree, GOOD.replace(*edit, 1) if edit else GOOD)
    with pytest.raises(PresetError) as info:
        build_federation(load_preset(path))
    text = str(info.value)
    assert text.startswith(f"{path}: datasets[0] (animals): ") and "\n" not in text and message in text


def test_names_resolve_to_shipped_files_and_unknown_names_fail():
    with pytest.raises(PresetError, match="^nosuch: no such preset or file"):
        load_preset("nosuch")
    with pytest.raises(PresetError, match="no such preset file"):
        load_preset("/nonexistent/x.toml")


def _float_fields() -> list[tuple[str, str]]:
    """(table, key) of every float setting a preset can hold (plain or optional)."""
    import typing

    from fedmvp.presets.schema import ServerSpec

    out = []
    for table, cls in (("train", TrainSpec), ("server", ServerSpec), ("datasets", DatasetSpec)):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] is float or typing.get_args(hints[f.name]) == (float, type(None)):
                out.append((table, f.name))
    return out


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("table,key", _float_fields())
def test_every_float_setting_must_be_finite(tmp_path, table, key, value):
    """TOML allows nan and inf; a range check like `lr < 0` is false for NaN, so lr = nan trained to NaN."""
    assert len(_float_fields()) >= 11  # lr .. dirichlet_alpha: a new float key is covered by itself
    header = "[[datasets]]" if table == "datasets" else f"[{table}]"
    text = ('name = "f"\nprotocol = "base-to-new"\n[train]\nrounds = 1\n[server]\n[[datasets]]\nname = "s"\n'
            'layout = "synthetic"\nroot = ""\n').replace(header + "\n", f"{header}\n{key} = {value}\n")
    path = write(tmp_path, text)
    with pytest.raises(PresetError, match=f"{key} must be a finite number"):
        load_preset(path, check_roots=False)


# ---- the server rules: one definition (fedmvp/presets/server.py) ------------------------------------------
SERVER_PRESET = ('name = "f"\nprotocol = "base-to-new"\n[train]\nrounds = 1\n[server]\n{line}\n[[datasets]]\n'
                 'name = "s"\nlayout = "synthetic"\nroot = ""\n')


@pytest.mark.parametrize("key, value, message", [
    ("round_timeout", 0.0, "round_timeout must be a finite number of seconds > 0, got 0.0"),
    ("min_nodes", 0, "min_nodes must be at least 1, got 0"),
    ("round_retries", 0, "round_retries must be at least 1, got 0"),
    ("max_update_norm", -1.0, "max_update_norm must be a finite number > 0, got -1.0"),
    ("edge_max_examples", 0, "edge_max_examples must be at least 1, got 0"),
    ("site_max_examples", 0, "site_max_examples must be at least 1, got 0"),
    ("max_staleness", -1, "max_staleness must be 0 or more, got -1"),
    ("update_norm_action", "drop", "update_norm_action must be 'reject' or 'clip', got 'drop'"),
])
def test_a_preset_and_a_run_record_pass_the_same_server_range_check(tmp_path, key, value, message):
    """A preset's [server] table, a run's recorded one and a run-time override are judged by one check."""
    from fedmvp.presets.server import ServerRecordError, ServerSpec

    line = f"{key} = {value!r}".replace("'", '"')
    with pytest.raises(PresetError, match=f"\\[server\\]: {message}"):
        load_preset(write(tmp_path, SERVER_PRESET.format(line=line)), check_roots=False)
    with pytest.raises(ServerRecordError, match=f"config.json: server {message}"):
        ServerSpec.from_record({**ServerSpec().record(), key: value}, "config.json")
    with pytest.raises(ServerRecordError, match=f"flags: server {message}"):
        ServerSpec().with_overrides({key: value}, "flags")


def test_server_rules_are_recorded_whole_and_read_back_exactly(tmp_path):
    """What the preset sets is what the strategy's policy and the reply rules see; no reader has defaults
    of its own (RoundPolicy and ReplyRules hold a ServerSpec)."""
    from fedmvp.federated.replies import ReplyRules
    from fedmvp.federated.strategy import RoundPolicy
    from fedmvp.presets.server import ServerRecordError, ServerSpec

    preset = load_preset(write(tmp_path, SERVER_PRESET.format(line="max_staleness = 2\nround_timeout = 7")),
                         check_roots=False)
    assert preset.server == ServerSpec(max_staleness=2, round_timeout=7.0)
    assert ServerSpec.from_record(preset.server.record(), "x") == preset.server
    assert set(preset.server.record()) == set(ServerSpec.keys())
    assert RoundPolicy().server == ReplyRules(run_id="r", round=1).server == ServerSpec()
    with pytest.raises(ServerRecordError, match="unknown key 'min_node'"):
        ServerSpec.from_record({**ServerSpec().record(), "min_node": 1}, "x")
    with pytest.raises(ServerRecordError, match="missing key 'min_nodes'"):
        ServerSpec.from_record({k: v for k, v in ServerSpec().record().items() if k != "min_nodes"}, "x")
