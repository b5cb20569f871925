"""examples/cpp's fedmvp_infer (libtorch, the bundle's TorchScript module; docs/howto/cpp-libtorch.md):
built with the system compiler against the torch wheel, it gives ONNX Runtime's top-1 on the bundle's
check images and on real photos written as PNG and JPEG, preprocesses them to Pillow's very pixels, and
refuses a model file the manifest's sha256 does not name."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from tests.deadlines import scaled

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def binary(tmp_path_factory) -> Path:
    """fedmvp_infer, built once per session into a temporary cache (the build seconds are printed)."""
    from benchmarks.cpp_build import build_binary, toolchain_problem

    problem = toolchain_problem()
    if problem is not None:
        pytest.skip(f"cannot build examples/cpp here: {problem}")
    path, seconds = build_binary(tmp_path_factory.getbasetemp() / "cpp-build")
    print(f"fedmvp_infer built in {seconds:.1f} s")
    return path


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    """A tiny random-init bundle with model.torchscript.pt. Read-only."""
    from benchmarks.edge_cpp import torchscript_bundle

    return torchscript_bundle(tmp_path_factory.mktemp("cpp-bundle"), "fedmvp-tiny")


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> list[Path]:
    """scikit-image's photos as PNG and JPEG, plus an EXIF-rotated JPEG, an RGBA PNG, a grey PNG and one
    smaller than the model's input (upsampled)."""
    data = pytest.importorskip("skimage.data", reason="the photos come from scikit-image (the dev extra)")
    from PIL import Image

    folder = tmp_path_factory.mktemp("photos")
    out = []
    for name, ext in [("astronaut", "png"), ("chelsea", "jpg"), ("coffee", "jpg"), ("rocket", "png"),
                      ("camera", "png")]:
        out.append(folder / f"{name}.{ext}")
        Image.fromarray(getattr(data, name)()).save(out[-1])
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated: stored landscape, shown portrait
    out.append(folder / "rotated.jpg")
    Image.fromarray(data.chelsea()[:, :400]).save(out[-1], exif=exif, quality=90)
    coffee = data.coffee()
    out.append(folder / "alpha.png")
    Image.fromarray(np.dstack([coffee, coffee[..., :1]])).save(out[-1])
    out.append(folder / "small.png")
    Image.fromarray(coffee[100:120, 200:227]).save(out[-1])
    return out


def _run(binary: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=scaled(300))


def _lines(proc: subprocess.CompletedProcess) -> list[dict]:
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _ort(bundle: Path, pixels: np.ndarray) -> np.ndarray:
    """ONNX Runtime's probabilities on normalised pixels, the bundle's own LoRA (edge-client's Predictor)."""
    from edge_client.bundle import read_bundle
    from edge_client.infer import Predictor

    return Predictor(read_bundle(bundle), personalised=False, runtime="ort", threads=1).run(pixels)["probs"]


def test_check_images_give_ort_top1_every_one(binary, bundle):
    from edge_client.bundle import read_bundle
    from edge_client.runtime_choice import check_images

    proc = _run(binary, str(bundle), "--check-images", "--json", "--top", "3", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    lines = _lines(proc)
    ort = _ort(bundle, check_images(read_bundle(bundle)))
    assert len(lines) == len(ort) >= 8 and all(line["ok"] for line in lines)
    assert [line["top_k"][0]["index"] for line in lines] == ort.argmax(-1).tolist()
    probs = np.array([[k["prob"] for k in line["top_k"]] for line in lines])
    assert np.max(np.abs(probs - np.sort(ort, -1)[:, ::-1][:, :3])) <= 1e-4
    names = json.loads((bundle / "manifest.json").read_text())["classes"]["names"]
    assert [line["top_k"][0]["class"] for line in lines] == [names[i] for i in ort.argmax(-1)]


def test_photos_are_preprocessed_to_pillows_pixels_and_give_ort_top1(binary, bundle, photos, tmp_path):
    from edge_client.bundle import read_bundle
    from edge_client.images import load_image
    from edge_client.preprocess import normalise, resize_crop_rgb

    spec = read_bundle(bundle).preprocess
    dump = tmp_path / "rgb.bin"
    assert _run(binary, str(bundle), *map(str, photos), "--dump-rgb", str(dump)).returncode == 0
    size = spec.image_size
    ours = np.fromfile(dump, np.uint8).reshape(len(photos), size, size, 3)
    pillow = np.stack([resize_crop_rgb(load_image(p), spec) for p in photos])
    assert np.array_equal(ours, pillow), [p.name for p, a, b in zip(photos, ours, pillow) if not np.array_equal(a, b)]
    proc = _run(binary, str(bundle), *map(str, photos), "--json", "--top", "1", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    lines = _lines(proc)
    assert [line["image"] for line in lines] == [str(p) for p in photos]
    assert [line["top_k"][0]["index"] for line in lines] == _ort(bundle, normalise(pillow, spec)).argmax(-1).tolist()


def test_the_resize_matches_pillow_at_other_sizes_and_filters(binary, bundle, photos, tmp_path):
    """The manifest decides size and filter: a 224 bilinear and an odd 97 bicubic crop, pixel for pixel."""
    from edge_client.images import load_image
    from edge_client.preprocess import PreprocessSpec, resize_crop_rgb

    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    manifest = json.loads((bundle / "manifest.json").read_text())
    for size, resize in [(224, "bilinear-shortest-side"), (97, "bicubic-shortest-side")]:
        manifest["preprocess"].update(image_size=size, resize=resize)
        (copy / "manifest.json").write_text(json.dumps(manifest))
        dump = tmp_path / f"rgb-{size}.bin"
        proc = _run(binary, str(copy), *map(str, photos), "--dump-rgb", str(dump))
        assert proc.returncode == 0, proc.stderr
        spec = PreprocessSpec.from_manifest(manifest)
        pillow = np.stack([resize_crop_rgb(load_image(p), spec) for p in photos])
        assert np.array_equal(np.fromfile(dump, np.uint8).reshape(pillow.shape), pillow), (size, resize)


def test_a_changed_model_file_is_refused_in_one_line(binary, bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    model = copy / "model.torchscript.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0x01
    model.write_bytes(bytes(data))
    proc = _run(binary, str(copy), "--check-images")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "model.torchscript.pt: sha256 does not match the manifest" in proc.stderr


def test_a_bundle_without_the_module_and_bad_images_are_one_line_each(binary, bundle, photos, tmp_path):
    jpeg = photos[1].read_bytes()
    header_only, cut = tmp_path / "header.jpg", tmp_path / "cut.jpg"
    header_only.write_bytes(jpeg[:300])
    cut.write_bytes(jpeg[: len(jpeg) // 2])  # Pillow refuses it; libjpeg alone would pad it with grey
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    proc = _run(binary, str(bundle), str(header_only), str(photos[0]), str(cut), str(text), "--json")
    assert proc.returncode == 1
    assert [line["ok"] for line in _lines(proc)] == [False, True, False, False]
    assert proc.stderr.splitlines() == [
        f"{header_only}: corrupt JPEG (truncated image)",
        f"{cut}: corrupt JPEG (truncated image)", f"{text}: not a JPEG or PNG file"]
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["torchscript"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    proc = _run(binary, str(copy), str(photos[0]))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no TorchScript module" in proc.stderr


def test_bench_prints_ms_per_image(binary, bundle):
    proc = _run(binary, str(bundle), "--bench", "3", "--batch", "4", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    bench = json.loads(proc.stdout)["bench"]
    assert bench["batch"] == 4 and bench["runs"] == 3 and 0 < bench["ms_per_image_min"] <= bench["ms_per_image_median"]


def test_cmake_configures_against_the_wheel_without_find_package_torch(tmp_path):
    """The CMake route (configure only: the build is the same command line as build.sh's)."""
    import sys

    from benchmarks.cpp_build import CPP_DIR, toolchain_problem

    if shutil.which("cmake") is None:
        pytest.skip("no cmake on PATH (build.sh is the route without it)")
    problem = toolchain_problem()
    if problem is not None:
        pytest.skip(f"cannot build examples/cpp here: {problem}")
    proc = subprocess.run(["cmake", "-S", str(CPP_DIR), "-B", str(tmp_path), f"-DPYTHON_FOR_TORCH={sys.executable}"],
                          capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stderr
    import torch

    abi = int(torch.compiled_with_cxx11_abi())
    assert f"torch: {Path(torch.__file__).parent} (_GLIBCXX_USE_CXX11_ABI={abi})" in proc.stdout
    code = [line for line in (CPP_DIR / "CMakeLists.txt").read_text().splitlines() if not line.lstrip().startswith("#")]
    assert not any("find_package(Torch" in line for line in code)


def test_another_lora_is_run_and_a_misshapen_one_refused(binary, bundle, tmp_path):
    """--lora: a device's personalised (or a round's global) LoRA gives ONNX Runtime's top-1 with that LoRA."""
    from safetensors.numpy import save_file

    from edge_client.bundle import read_bundle
    from edge_client.infer import Predictor
    from edge_client.lora_store import ActiveLora
    from edge_client.runtime_choice import check_images

    opened = read_bundle(bundle)
    rng = np.random.default_rng(0)
    lora = {k: (v + rng.normal(0, 0.5, v.shape)).astype(np.float32) for k, v in opened.lora().items()}
    path = tmp_path / "mine.safetensors"
    save_file(lora, str(path))
    proc = _run(binary, str(bundle), "--check-images", "--json", "--top", "1", "--lora", str(path), "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    ort = Predictor(opened, runtime="ort", threads=1, lora=ActiveLora(lora, "global", path)).run(check_images(opened))
    assert [line["top_k"][0]["index"] for line in _lines(proc)] == ort["probs"].argmax(-1).tolist()
    assert np.allclose([line["top_k"][0]["prob"] for line in _lines(proc)], ort["probs"].max(-1), atol=1e-4)
    stored = _lines(_run(binary, str(bundle), "--check-images", "--json", "--top", "1"))
    assert [line["top_k"][0]["index"] for line in stored] != ort["probs"].argmax(-1).tolist()  # the file given ran
    first = next(iter(lora))
    save_file({**lora, first: lora[first][:-1]}, str(path))
    proc = _run(binary, str(bundle), "--check-images", "--lora", str(path))
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1
    assert f"tensor '{first}' has another shape than the manifest's" in proc.stderr
