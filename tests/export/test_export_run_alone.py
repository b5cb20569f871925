"""fedmvp-export on a machine that holds the run directory and nothing else (issue 24 §4): the class set
comes from the run's record, parity from --images or generated pixels with one warning line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from export_helpers import write_dataset, write_preset, write_run

from edge_client.bundle import read_bundle
from fedmvp.runs import RunDir
from fedmvp_apps.export_cli import main

GENERATED = "generated images"


@pytest.fixture(scope="module")
def lone_run(tmp_path_factory) -> tuple[Path, Path, list[str]]:
    """(a copy of the run alone, a folder of 34 images in nested folders, the class set built from the data).
    The world and the preset the run was made from are deleted afterwards: nothing of them is reachable."""
    from fedmvp.run_classes import federation_classes

    origin = tmp_path_factory.mktemp("origin")
    write_dataset(origin / "data")
    write_preset(origin / "preset.toml", origin / "data")
    write_run(origin / "run", origin / "preset.toml")
    expected = [c.name for c in federation_classes(RunDir(origin / "run").federation())]
    images = tmp_path_factory.mktemp("pictures")
    for i, path in enumerate(sorted((origin / "data").rglob("*.png"))[:34]):
        target = images / ("a" if i % 2 else "b/c") / f"{i}.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)
    elsewhere = tmp_path_factory.mktemp("elsewhere") / "run"
    shutil.copytree(origin / "run", elsewhere)
    shutil.rmtree(origin)
    return elsewhere, images, expected


def _export(run: Path, out: Path, *extra: str):
    return CliRunner().invoke(main, ["--run", str(run), "--round", "2", "--out", str(out), *extra])


def test_export_without_the_data_bakes_the_recorded_class_set_and_warns_once(lone_run, tmp_path):
    run, _, expected = lone_run
    result = _export(run, tmp_path / "b")
    assert result.exit_code == 0, result.output
    bundle = read_bundle(tmp_path / "b")
    assert bundle.class_names == [c.name for c in RunDir(run).class_set()] == expected
    assert len(expected) == 12  # base then new: the federation's whole set
    warned = [line for line in result.stderr.splitlines() if GENERATED in line]
    assert len(warned) == 1 and warned[0].startswith("warning: parity on 32 generated images"), result.stderr
    assert "--images DIR" in warned[0] and "cannot rebuild the run's data" in warned[0]
    assert bundle.manifest["parity"]["images"] == {"run": 0, "synthetic": 32}
    assert bundle.manifest["parity"]["fp32"]["passed"]


def test_images_flag_reaches_the_parity_check(lone_run, tmp_path):
    run, images, expected = lone_run
    result = _export(run, tmp_path / "b", "--images", str(images), "--json")
    assert result.exit_code == 0, result.output
    assert GENERATED not in result.stderr, result.stderr
    parity = json.loads(result.stdout)["parity"]
    assert parity["fp32"]["images"] == 34  # every image of the folder, nested ones included, no noise
    manifest = read_bundle(tmp_path / "b").manifest
    assert manifest["parity"]["images"] == {"folder": 34, "synthetic": 0}
    assert manifest["classes"]["names"] == expected


def test_images_flag_refuses_what_is_no_folder_of_images(lone_run, tmp_path):
    run, _, _ = lone_run
    empty = tmp_path / "empty"
    empty.mkdir()
    for given in (tmp_path / "missing", empty):
        result = _export(run, tmp_path / "b", "--images", str(given))
        assert result.exit_code == 2 and f"error: {given}" in result.stderr, result.output
        assert not (tmp_path / "b").exists()


def test_int8_calibration_without_the_data_is_generated_and_said_in_the_same_line(lone_run):
    """export_images: one line for parity and calibration; with --images the calibration uses those."""
    from torchvision import transforms as T

    from export.run_inputs import export_images

    run, images, _ = lone_run
    preprocess = T.Compose([T.Resize(32), T.CenterCrop(32), T.ToTensor()])
    chosen = export_images(RunDir(run), preprocess, 32, 256, None, int8=True)
    assert chosen.warning.count(GENERATED) == 2 and "int8 calibration on 32 generated images" in chosen.warning
    assert len(chosen.calibration) == 32 and chosen.note == {"run": 0, "synthetic": 32}
    assert chosen.calibration_real == 0  # static int8 could calibrate on nothing real (auto: dynamic)
    given = export_images(RunDir(run), preprocess, 32, 256, images, int8=True)
    assert given.warning is None and given.calibration is None  # write_bundle calibrates on the folder's images
    assert given.calibration_real == 34
    assert len(given.parity) == 34


def test_an_old_run_without_the_class_record_is_migrated_with_a_warning(run_copy, tiny_bundle, tmp_path, capsys):
    """A run made before classes.json: the class set rebuilt from its preset and data, in the same order."""
    from export.bundle_writer import export_bundle

    (run_copy / "classes.json").unlink()
    capsys.readouterr()
    result = export_bundle(run_copy, 2, tmp_path / "b")
    err = capsys.readouterr().err
    assert err.count("no class record") == 1 and "docs/architecture.md, Migrations" in err, err
    assert result.manifest["classes"] == tiny_bundle.manifest["classes"]


def test_an_old_run_without_the_data_is_one_line(lone_run, tmp_path):
    run, _, _ = lone_run
    old = tmp_path / "old"
    shutil.copytree(run, old)
    (old / "classes.json").unlink()
    result = _export(old, tmp_path / "b")
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[-1].startswith("error: ") and "cannot rebuild the run's data" in result.stderr


def test_int8_without_labelled_images_says_so_once_and_keeps_layers_by_agreement(lone_run, tmp_path):
    """--images whose folders are not the bundle's classes, the run's test images gone: one warning line,
    and the plan's criterion is today's top-1 agreement with fp32 (no accuracy recorded)."""
    run, images, _ = lone_run
    result = _export(run, tmp_path / "b", "--images", str(images), "--precision", "int8", "--inference-only")
    assert result.exit_code == 0, result.output
    warned = [line for line in result.stderr.splitlines() if "labelled held-out" in line]
    assert warned == [f"warning: int8: fewer than 32 labelled held-out images ({images} holds no 32 images in "
                      f"<class>/ folders of the bundle's classes); layers kept fp32 by top-1 agreement with fp32 "
                      f"instead of --max-accuracy-drop"], result.stderr
    plan = read_bundle(tmp_path / "b").manifest["onnx"]["int8"]
    assert plan["criterion"] == "agreement" and plan["accuracy"] is None
    assert plan["calibration_agreement"] >= plan["target_agreement"] == 0.99


def test_int8_auto_without_any_real_image_is_dynamic_and_says_why_in_one_line(lone_run, tmp_path):
    """The run's data gone and no --images: static would calibrate on generated pixels, so auto plans
    dynamic only; one warning line says which scheme and why, and the manifest records the same."""
    run, _, _ = lone_run
    result = _export(run, tmp_path / "b", "--precision", "int8", "--inference-only")
    assert result.exit_code == 0, result.output
    warned = [line for line in result.stderr.splitlines() if "quantisation" in line]
    assert warned == ["warning: int8: dynamic quantisation (auto): no real calibration images (neither the run's "
                      "training images nor --images), and static int8 would calibrate its activation ranges on "
                      "generated pixels"], result.stderr
    plan = read_bundle(tmp_path / "b").manifest["onnx"]["int8"]
    assert plan["scheme"] == "dynamic" and plan["scheme_choice"]["asked"] == "auto"
    assert plan["scheme_choice"]["why"] == warned[0].removeprefix("warning: ")
