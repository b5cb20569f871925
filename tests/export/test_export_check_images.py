"""The exporter ships its parity images as the bundle's check images (export/check_images.py), and
`--no-check-images` ships generated colour fields instead, so no test image leaves the machine."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from export_helpers import rebuilt_model
from safetensors.numpy import load_file

from edge_client.bundle import Bundle
from edge_client.check_images import colour_fields
from edge_client.preprocess import PreprocessSpec, normalise
from export import check_images
from export.errors import ExportError
from export.run_inputs import export_images
from fedmvp.runs import RunDir

CHECK = "check_images.safetensors"


def test_the_bundle_carries_the_first_32_parity_images(tiny_bundle, tiny_run):
    section = tiny_bundle.manifest["check_images"]
    assert section == {"file": CHECK, "source": "run-test", "images": 32, "generated": 0,
                       "layout": check_images.LAYOUT}
    assert tiny_bundle.manifest["files_by_role"]["check"] == CHECK and CHECK in tiny_bundle.manifest["files"]
    assert tiny_bundle.check is not None and "32 of the run's test images travel" in "\n".join(tiny_bundle.lines())
    _, clip = rebuilt_model(tiny_run)
    parity = export_images(RunDir(tiny_run), clip.preprocess, clip.image_size, 256, None, int8=False).parity
    shipped = Bundle.open(tiny_bundle.path).check_images()
    np.testing.assert_allclose(shipped.pixels, parity[:32].numpy(), atol=1e-5)  # what the device normalises back


def test_no_check_images_ships_generated_colour_fields(tiny_run, tmp_path):
    from fedmvp_apps.export_cli import main

    out = CliRunner().invoke(main, ["--run", str(tiny_run), "--round", "2", "--out", str(tmp_path / "b"),
                                    "--parity-images", "32", "--no-check-images", "--json"])
    assert out.exit_code == 0, out.output
    said = json.loads(out.stdout)
    assert said["check_images"]["source"] == "generated" and said["check_images"]["generated"] == 32
    pixels = load_file(str(tmp_path / "b" / CHECK))["images"]
    size = pixels.shape[1]
    np.testing.assert_array_equal(pixels, colour_fields(check_images.GENERATED_SEED, 32, size))
    assert Bundle.open(tmp_path / "b").check_images().source == "generated"


def _spec() -> PreprocessSpec:
    return PreprocessSpec(image_size=8)


def _pictures(count: int) -> tuple[np.ndarray, torch.Tensor]:
    pixels = np.random.default_rng(1).integers(0, 256, size=(count, 8, 8, 3), dtype=np.uint8)
    return pixels, torch.from_numpy(normalise(pixels, _spec()))


def test_images_folder_pictures_are_the_source_images_and_recovered_exactly():
    pixels, images = _pictures(40)
    shipped = check_images.from_parity(images, {"folder": 40, "synthetic": 0}, _spec())
    assert shipped.source == "images" and shipped.generated == 0
    np.testing.assert_array_equal(shipped.pixels, pixels[:32])


def test_fewer_real_pictures_are_topped_up_with_colour_fields():
    pixels, images = _pictures(5)
    noise = torch.randn(27, 3, 8, 8)
    shipped = check_images.from_parity(torch.cat([images, noise]), {"run": 5, "synthetic": 27}, _spec())
    assert shipped.source == "run-test" and shipped.generated == 27 and len(shipped.pixels) == 32
    np.testing.assert_array_equal(shipped.pixels[:5], pixels)
    np.testing.assert_array_equal(shipped.pixels[5:], colour_fields(check_images.GENERATED_SEED, 27, 8))
    only_noise = check_images.from_parity(noise, {"run": 0, "synthetic": 27}, _spec())
    assert only_noise.source == "generated"


def test_parity_tensors_that_are_not_pictures_are_refused():
    with pytest.raises(ExportError, match="not pictures normalised"):
        check_images.to_uint8(torch.randn(2, 3, 8, 8) * 0.001 + 0.0005, _spec())

