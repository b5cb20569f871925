"""The models the edge benchmark times, built once into a work folder.

PyTorch: open_clip's image encoder alone, and the fedmvp prompted model with cached attribute
text features (the training core's forward). ONNX: the plain image encoder, the bundle's
``model.onnx`` in fp32 and in the exporter's int8 (accuracy guard), and two int8 variants with
every weight MatMul quantised: dynamic (ONNX Runtime's ``quantize_dynamic``) and static
(calibrated QDQ). The fp32 bundle also carries ``model.torchscript.pt`` (`fedmvp-export --format
torchscript`), run by the engine rows of ``benchmarks/edge_engines.py``. A random-init backbone unless
a run is given: speed does not depend on the weights; agreement on random weights does (near-tied logits), see ``benchmarks/edge.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch


@dataclass
class EdgeModels:
    """Everything the edge section runs, and what building it cost."""

    name: str
    image_size: int
    classes: int
    attributes: int
    clip: object
    model: torch.nn.Module  # FedMVP with text features set
    onnx: dict[str, Path] = field(default_factory=dict)  # runtime name -> model file
    build_seconds: dict[str, float] = field(default_factory=dict)
    int8_plan: dict | None = None
    file_bytes: dict[str, int] = field(default_factory=dict)
    parity: dict[str, dict] = field(default_factory=dict)  # the fp32 bundle's parity records (fp32, torchscript)

    @property
    def bundle(self) -> Path:
        """The fp32 bundle's folder (model.onnx, model.torchscript.pt, check images)."""
        return self.onnx["ort_fp32"].parent


def class_set(classes: int, attributes: int):
    """``classes`` made-up classes with ``attributes`` attribute phrases each."""
    from export.class_set import ClassSet

    names = [f"class {i:03d}" for i in range(classes)]
    phrases = ("a round outline", "a bright colour", "small spots", "a long tail", "pointed ears",
               "a striped pattern", "a glossy surface", "four legs", "a curved beak", "thin wings",
               "a rough texture", "a dark stripe")
    return ClassSet(names=names, attributes={n: [f"{phrases[j % len(phrases)]} {i}" for j in range(attributes)]
                                             for i, n in enumerate(names)}, source="benchmark")


def load_backbone(name: str, pretrained: str | None):
    from fedmvp.clip import load_clip

    torch.manual_seed(0)
    return load_clip(name, pretrained)


def random_bundle(work: Path, name: str, classes: int, attributes: int, *, training: bool = True,
                  torchscript: bool = False) -> Path:
    """A bundle of a random-init ``name`` backbone (shipped weights for fedmvp-tiny) over ``class_set``:
    what the benchmarks and gpu_check.sh time and train on (speed and memory do not depend on weights).
    ``torchscript``: with the TorchScript modules too (``--format torchscript``)."""
    from export.bundle_writer import BundleInputs, BundleOptions, write_bundle
    from export.parity import MIN_IMAGES
    from export.run_inputs import synthetic_images
    from fedmvp.model import FedMVP

    clip = load_backbone(name, "synthetic" if name == "fedmvp-tiny" else None)
    out = work / f"bundle-{name}"
    write_bundle(FedMVP(clip), clip, class_set(classes, attributes), out,
                 BundleInputs(synthetic_images(MIN_IMAGES, clip.image_size)),
                 BundleOptions(training=training, torchscript=torchscript))
    return out


def write_image_folder(root: Path, names: list[str], count: int, size: tuple[int, int] = (64, 48)) -> Path:
    """An ImageFolder of ``count`` random PNGs (``size`` = width, height) spread over the classes ``names``."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(count):
        folder = root / names[i % len(names)]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(folder / f"{i:04d}.png")
    return root


def model_bytes(path: Path) -> int:
    """The ONNX file plus any external data it reads (the fp32 model reads weights.safetensors)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    external = {entry.value for init in proto.graph.initializer for entry in init.external_data
                if entry.key == "location"}
    return path.stat().st_size + sum((path.parent / name).stat().st_size for name in external)


@contextmanager
def step_seconds(step: str, sink: dict[str, float], key: str) -> Iterator[None]:
    """Time one step of the bundle writer (``export.bundle_steps.BundleWrite.<step>``) into ``sink[key]``:
    the TorchScript trace and its parity apart from the ONNX export they are written with."""
    from export.bundle_steps import BundleWrite

    original = getattr(BundleWrite, step, None)
    if original is None:  # the writer's steps renamed: the step's seconds stay in the export's
        yield
        return

    def timed(self, *args, **kwargs):  # noqa: ANN001, ANN202 - the wrapped method's own signature
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            sink[key] = sink.get(key, 0.0) + time.perf_counter() - start

    setattr(BundleWrite, step, timed)
    try:
        yield
    finally:
        setattr(BundleWrite, step, original)


def build(name: str, work: Path, *, classes: int, attributes: int, pretrained: str | None = None,
          int8: bool = True, variants: bool = True, calibration_images: int = 32, fp16: bool = False,
          torchscript: bool = True) -> EdgeModels:
    """Build every model of the edge table into ``work`` (the bundle export's own checks included);
    ``torchscript``: the fp32 bundle carries model.torchscript.pt, parity-checked by the exporter."""
    from export.bundle_writer import BundleInputs, BundleOptions, write_bundle
    from export.class_set import text_features
    from export.onnx_export import export_plain_visual
    from export.run_inputs import synthetic_images
    from fedmvp.model import FedMVP

    clip = load_backbone(name, pretrained)
    model = FedMVP(clip).eval()
    classes_set = class_set(classes, attributes)
    out = EdgeModels(name=name, image_size=clip.image_size, classes=classes, attributes=attributes,
                     clip=clip, model=model)
    images = synthetic_images(max(32, calibration_images), clip.image_size)

    start = time.perf_counter()
    model.set_text_features(text_features(clip, classes_set))
    out.build_seconds["text_features"] = time.perf_counter() - start

    start = time.perf_counter()
    # with TorchScript the bundle is trainable too (train.pt2 and train.torchscript.pt), so the LoRA-step rows
    # (benchmarks/edge_hooks.py) train on this very bundle instead of exporting a second one
    with step_seconds("torchscript", out.build_seconds, "export_torchscript"), \
            step_seconds("program", out.build_seconds, "export_training"), \
            step_seconds("torchscript_training", out.build_seconds, "export_training"):
        fp32 = write_bundle(model, clip, classes_set, work / "fp32", BundleInputs(images),
                            BundleOptions(training=torchscript, torchscript=torchscript))
    # the ONNX export alone, as before (edge.py subtracts it from the int8 export to time the int8 guard)
    out.build_seconds["export_fp32"] = time.perf_counter() - start - out.build_seconds.get("export_torchscript", 0.0) \
        - out.build_seconds.get("export_training", 0.0)
    out.onnx["ort_fp32"] = fp32.path / "model.onnx"
    out.parity = {key: result.to_manifest() for key, result in fp32.parity.items()}
    if torchscript:
        out.file_bytes["torchscript"] = (fp32.path / "model.torchscript.pt").stat().st_size

    start = time.perf_counter()
    export_plain_visual(clip.model.visual, clip.image_size, work / "plain.onnx")  # fused like the bundle's
    out.onnx["ort_plain_fp32"] = work / "plain.onnx"
    out.build_seconds["export_plain"] = time.perf_counter() - start

    if fp16:  # the GPU table's ONNX Runtime CUDA / TensorRT rows
        start = time.perf_counter()
        half = write_bundle(model, clip, classes_set, work / "fp16", BundleInputs(images),
                            BundleOptions(precision="fp16", training=False))
        out.build_seconds["export_fp16"] = time.perf_counter() - start
        out.onnx["ort_fp16"] = half.path / "model.onnx"
    if int8:
        calibration = synthetic_images(calibration_images, clip.image_size, seed=1)
        start = time.perf_counter()
        bundle = write_bundle(model, clip, classes_set, work / "int8", BundleInputs(images, calibration=calibration),
                              BundleOptions(precision="int8", training=False))
        out.build_seconds["export_int8_guard"] = time.perf_counter() - start
        out.onnx["ort_int8"] = bundle.path / "model.onnx"
        out.int8_plan = bundle.int8.to_manifest() if bundle.int8 else None
    if variants:
        from benchmarks.int8_variants import write_variants

        calibration = synthetic_images(calibration_images, clip.image_size, seed=1).numpy()
        for key, (path, seconds) in write_variants(out.onnx["ort_fp32"], calibration, work).items():
            out.onnx[key], out.build_seconds[f"quantize_{key}"] = path, seconds
    out.file_bytes.update({key: model_bytes(path) for key, path in out.onnx.items()})
    return out


def random_pixels(batch: int, image_size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 3, image_size, image_size)).astype(np.float32)
