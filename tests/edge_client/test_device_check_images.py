"""The bundle's check images on the device: `auto` verifies on the shipped pictures, a bundle exported before
them still works (colour fields from its id), a bad file is one line (docs/architecture.md, "Runtimes")."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import save_file

from edge_client.bundle import Bundle
from edge_client.check_images import colour_fields, generated_check_images, write_check_images
from edge_client.infer import Predictor
from edge_client.runtime_choice import choose
from fedmvp_formats.bundle_manifest import file_entries
from fedmvp_apps.edge_cli import main

CHECK = "check_images.safetensors"


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDMVP_CACHE", str(tmp_path / "cache"))


def _rehash(bundle: Path, edit=None) -> None:
    """Re-list the check file's sha256 and size in the manifest (as a server that shaped it would), after ``edit``."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    if edit:
        edit(manifest)
    if CHECK in manifest["files"]:
        manifest["files"].update(file_entries(bundle, [CHECK]))
    (bundle / "manifest.json").write_text(json.dumps(manifest))


def _reference(bundle: Bundle) -> np.ndarray:
    record = json.loads(choose(bundle, "auto", "auto", "cpu").cache.read_text())
    return np.asarray(record["reference"])


def test_auto_verifies_on_the_shipped_pictures_and_other_pictures_are_another_verdict(bundle_dir):
    pytest.importorskip("openvino")
    bundle = Bundle.open(bundle_dir)
    old_id = bundle.id  # Bundle.id reads manifest.json each time
    shipped = bundle.check_images()
    assert shipped.source == "run-test" and shipped.pixels.shape[0] == 32
    choice = choose(bundle, "auto", "auto", "cpu")
    assert "check images (the run's test images)" in choice.line
    info = CliRunner().invoke(main, ["info", "--bundle", str(bundle_dir), "--json"])
    assert json.loads(info.stdout)["bundle"]["check_images"] == "run-test"
    record = json.loads(choice.cache.read_text())
    assert record["check"]["source"] == "run-test" and record["check"]["sha256"] == shipped.sha256
    # the reference is the bundle as exported on the shipped pictures, normalised as infer normalises a file
    ort = Predictor(bundle, provider="cpu", personalised=False).run(shipped.pixels)["logits"]
    np.testing.assert_allclose(record["reference"], ort, atol=1e-5)
    # other pictures in the file: another bundle id, another cache record, other reference logits
    size = bundle.preprocess.image_size
    write_check_images(bundle_dir / CHECK, colour_fields(5, 32, size))
    _rehash(bundle_dir)
    changed = Bundle.open(bundle_dir)
    assert changed.id != old_id
    again = choose(changed, "auto", "auto", "cpu")
    assert not again.cached and again.cache != choice.cache
    assert not np.allclose(_reference(changed), record["reference"], atol=1e-3)


def test_a_bundle_exported_before_check_images_verifies_on_colour_fields_of_its_id(bundle_dir):
    (bundle_dir / CHECK).unlink()

    def drop(manifest):
        del manifest["files"][CHECK], manifest["files_by_role"]["check"], manifest["check_images"]
    _rehash(bundle_dir, drop)
    bundle = Bundle.open(bundle_dir)
    found = bundle.check_images()
    assert found.source == "bundle-id" and found.sha256 is None
    info = CliRunner().invoke(main, ["info", "--bundle", str(bundle_dir)])
    assert "checks:   colour fields drawn from the bundle id" in info.stdout
    np.testing.assert_array_equal(found.pixels, generated_check_images(bundle.id, bundle.preprocess))
    choice = choose(bundle, "auto", "auto", "cpu")
    if choice.cache is not None:  # more than one candidate here: verified on the id's colour fields
        assert "drawn from the bundle id" in choice.line
        assert json.loads(choice.cache.read_text())["check"]["seed"] == int(bundle.id[:16], 16)


BAD_FILES = [  # (what, write the file, what the line says)
    ("float32 pixels", lambda p, s: save_file({"images": np.zeros((32, s, s, 3), np.float32)}, str(p)),
     "dtype 'F32'; only U8 is accepted"),
    ("wrong size", lambda p, s: write_check_images(p, np.zeros((32, s + 1, s + 1, 3), np.uint8)),
     "check images: shape [32, 33, 33, 3] is not [32, 32, 32, 3]"),
    ("fewer than listed", lambda p, s: write_check_images(p, np.zeros((8, s, s, 3), np.uint8)),
     "check images: shape [8, 32, 32, 3] is not [32, 32, 32, 3]"),
    ("another tensor", lambda p, s: save_file({"pixels": np.zeros((32, s, s, 3), np.uint8)}, str(p)),
     "not the one tensor 'images'"),
    ("not safetensors", lambda p, s: p.write_bytes(b"\x00" * 64), "not a safetensors file"),
]


@pytest.mark.parametrize("what, write, says", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_a_bad_check_file_is_one_line_exit_2(bundle_dir, data_root, what, write, says):
    size = Bundle.open(bundle_dir).preprocess.image_size
    assert size == 32  # the lines above name the tiny model's size
    write(bundle_dir / CHECK, size)
    _rehash(bundle_dir)
    image = str(sorted((data_root / "test" / "red_circle").glob("*.png"))[0])
    out = CliRunner().invoke(main, ["infer", image, "--bundle", str(bundle_dir), "--runtime", "auto"])
    assert out.exit_code == 2, out.output
    line = out.stderr.strip()
    assert "\n" not in line and str(bundle_dir / CHECK) in line and says in line
