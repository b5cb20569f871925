"""On-device inference with ONNX Runtime or OpenVINO: files in, top-k classes out. No torch anywhere here.

The bundle is verified (every sha256 in its manifest) before the model is loaded; the LoRA
the device runs is the bundle's own or, after `edge-client train`, the personalised one
(``edge_client.lora_store``), given to the runtime in place of the stored initializers; the
runtime and precision are named or picked by ``auto`` (``edge_client/runtime_choice.py``).
Images are decoded and preprocessed in numpy/Pillow (``images``, ``preprocess``), one
batch ahead of the model in a background thread, and run through one session in batches.
A file that cannot be read becomes a `FileFailure` and the others are still classified.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.bundle import Bundle, BundleError
from edge_client.images import DEFAULT_MAX_PIXELS, ImageReadError, iter_image_paths, load_image, path_fields, printable
from edge_client.lora_store import ActiveLora, active_lora, bundle_lora
from edge_client.preprocess import preprocess
from edge_client.engines import Engine, open_engine
from edge_client.runtime_choice import choose
from edge_client.update import check_lora

DEFAULT_BATCH_SIZE = 8
DEFAULT_TOP_K = 5
LOAD_ATTEMPTS = 5  # loads of a bundle directory that keeps being replaced before giving up


@dataclass
class Prediction:
    """Top-k classes of one image, with timings in milliseconds."""

    path: Path
    top_k: list[tuple[str, float]]
    latency_ms: float  # decode + preprocess of this file + its share of the batch's model time
    decode_ms: float
    model_ms: float

    @property
    def label(self) -> str:
        """The top-1 class."""
        return self.top_k[0][0]

    @property
    def prob(self) -> float:
        """The top-1 probability."""
        return self.top_k[0][1]

    def to_json(self) -> dict[str, Any]:
        return {**path_fields(self.path), "top_k": [{"class": c, "prob": round(p, 6)} for c, p in self.top_k],
                "latency_ms": round(self.latency_ms, 3), "decode_ms": round(self.decode_ms, 3),
                "model_ms": round(self.model_ms, 3)}


@dataclass
class FileFailure:
    """One input that could not be classified; ``error`` is one line."""

    path: Path
    error: str

    def to_json(self) -> dict[str, Any]:
        return {**path_fields(self.path), "error": printable(self.error)}


@dataclass
class InferResult:
    """Everything `infer_paths` did."""

    predictions: list[Prediction]
    errors: list[FileFailure]
    provider: str
    bundle: Path
    round: int | None
    lora: dict[str, Any]
    batch_size: int
    seconds: float = 0.0
    classes: list[str] = field(default_factory=list)
    runtime: str = "ort"
    precision: str = "fp32"

    @property
    def ok(self) -> bool:
        """Whether every input was classified."""
        return not self.errors

    def accuracy(self, label_of: Callable[[Path], str] | None = None) -> float | None:
        """Top-1 accuracy against ``label_of(path)`` (default: the parent folder's name);
        predictions whose true label is not a bundle class are left out. None if none count."""
        label_of = label_of or (lambda p: p.parent.name)
        pairs = [(p.label, label_of(p.path)) for p in self.predictions]
        pairs = [(got, want) for got, want in pairs if want in self.classes] if self.classes else pairs
        return None if not pairs else sum(got == want for got, want in pairs) / len(pairs)

    def summary(self) -> dict[str, Any]:
        """Counts and throughput for the closing line of `edge-client infer`."""
        images = len(self.predictions)
        return {"images": images, "failed": len(self.errors), "provider": self.provider,
                "runtime": self.runtime, "precision": self.precision, "bundle": str(self.bundle),
                "round": self.round, "lora": self.lora.get("source"), "batch_size": self.batch_size,
                "seconds": round(self.seconds, 3),
                "images_per_second": round(images / self.seconds, 3) if self.seconds > 0 and images else None}


class Predictor:
    """A verified bundle on one runtime (ONNX Runtime or OpenVINO, ``edge_client/engines.py``), personalised
    LoRA applied."""

    def __init__(self, bundle: str | os.PathLike | Bundle | None = None, provider: str = "auto",
                 threads: int | None = None, personalised: bool = True,
                 lora: ActiveLora | None = None, runtime: str = "ort", precision: str = "auto") -> None:
        """``lora``: run these LoRA tensors (e.g. a federation round's global LoRA) instead of the
        device's own; their names and shapes must be the bundle's. ``runtime`` (ort | openvino | auto) and
        ``precision`` (auto | fp32 | bf16 | fp16 | int8): what runs it, chosen by ``runtime_choice.choose``
        (``auto``: the fastest verified here; ``self.choice.line`` says what). ``provider``: ONNX Runtime's.
        A bundle directory replaced while it loads (`fedmvp-export --force`, ./bundle pointed elsewhere) is
        loaded again, whole: the model never mixes the old bundle's files with the new one's, nor fails on
        their hashes."""
        where = None if isinstance(bundle, Bundle) else Bundle.resolve_dir(bundle)
        for attempt in range(1, LOAD_ATTEMPTS + 1):
            before = _identity(where)
            try:
                self._load(bundle, provider, threads, personalised, lora, runtime, precision)
            except Exception:
                if _identity(where) == before or attempt == LOAD_ATTEMPTS:
                    raise
                continue
            if _identity(where) == before:
                return
        raise BundleError(f"{where}: replaced {LOAD_ATTEMPTS} times while it loaded; try again")

    def _load(self, bundle: str | os.PathLike | Bundle | None, provider: str, threads: int | None,
              personalised: bool, lora: ActiveLora | None, runtime: str, precision: str) -> None:
        """Verify the bundle, choose the LoRA and the runtime, open the model."""
        self.bundle = Bundle.open(bundle, verify=True)
        if lora is None:
            lora = active_lora(self.bundle) if personalised else bundle_lora(self.bundle)
        else:
            check_lora(lora.tensors, self.bundle.lora_shapes, self.bundle.path, BundleError)
        self.lora: ActiveLora = lora
        self.choice = choose(self.bundle, runtime, precision, provider, threads)
        overrides = self.lora.tensors if self.lora.source != "bundle" else None  # the stored ones otherwise
        self._lora_feed: dict[str, np.ndarray] = {}
        if self.choice.engine is not None:  # built (with the bundle's LoRA) while auto verified it
            self.engine: Engine = self.choice.engine
            self.choice.engine = None
        else:
            self.engine = open_engine(self.bundle, self.choice.candidate, provider, threads, initializers=overrides)
            overrides = None
        self.provider = self.engine.device
        self.spec = self.bundle.preprocess
        self.classes = self.bundle.class_names
        wanted = self.bundle.manifest.get("onnx", {}).get("input", next(iter(self.engine.inputs)))
        self._input = wanted if wanted in self.engine.inputs else next(iter(self.engine.inputs))
        self._dtype = self.engine.inputs[self._input]
        self._outputs = list(self.engine.outputs)
        self._check_outputs()
        if overrides is not None:
            self.use_lora(self.lora)

    def use_lora(self, lora: ActiveLora) -> None:
        """Run ``lora`` from now on, on this model: the bundle's LoRA tensors are graph inputs with defaults
        (export/onnx_export.py; OpenVINO's made Parameters, edge_client/openvino_runtime.py), so they are fed
        per run instead of opening the model again.

        Why: a federation node evaluates the round's global LoRA every round; a new ONNX Runtime session
        each time re-reads and re-optimises the whole model (docs/architecture.md, "Layers": the warm executor)."""
        check_lora(lora.tensors, self.bundle.lora_shapes, self.bundle.path, BundleError)
        missing = sorted(set(self.bundle.lora_shapes) - set(self.engine.lora_dtypes))
        if missing:  # a model whose LoRA the runtime folded into constants: it cannot be fed
            raise BundleError(f"{self.bundle.file('onnx')}: LoRA tensor {missing[0]} cannot be overridden; "
                              f"export the bundle again")
        self._lora_feed = {name: np.ascontiguousarray(value, dtype=self.engine.lora_dtypes[name])
                           for name, value in lora.tensors.items()}
        self.lora = lora

    def _check_outputs(self) -> None:
        """The model's class dimension is the manifest's class count (else a name lookup would fail)."""
        for name, width in self.engine.output_widths.items():
            if name in ("logits", "probs") and isinstance(width, int) and width != len(self.classes):
                raise BundleError(f"{self.bundle.path / 'manifest.json'}: field classes.names lists "
                                  f"{len(self.classes)} classes, model.onnx outputs {width}")

    def run(self, pixel_values: np.ndarray) -> dict[str, np.ndarray]:
        """Preprocessed images [N, 3, S, S] -> every model output by name (logits, probs, image_embeds)."""
        feed = {self._input: np.ascontiguousarray(pixel_values, dtype=self._dtype), **self._lora_feed}
        return dict(zip(self._outputs, self.engine.run(feed)))

    def decode(self, path: Path, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> tuple[np.ndarray, float]:
        """One file -> (preprocessed [3, S, S], milliseconds); raises ImageReadError."""
        start = time.perf_counter()
        image = load_image(path, max_pixels=max_pixels)
        try:
            array = preprocess(image, self.spec)
        except (OSError, ValueError) as err:
            raise ImageReadError(path, f"cannot preprocess ({err})") from None
        return array, (time.perf_counter() - start) * 1000.0

    def infer(self, inputs: Sequence[str | os.PathLike], top_k: int = DEFAULT_TOP_K,
              batch_size: int = DEFAULT_BATCH_SIZE, max_pixels: int | None = DEFAULT_MAX_PIXELS,
              progress: bool = False, on_result: Callable[[Prediction | FileFailure], None] | None = None
              ) -> InferResult:
        """Classify files, directories (recursive) and globs; see `infer_paths`."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be a positive int, got {top_k!r}")
        k = min(top_k, len(self.classes))
        start = time.perf_counter()
        expand_errors: list[ImageReadError] = []
        paths = iter_image_paths(list(inputs), errors=expand_errors)
        predictions: list[Prediction] = []
        errors: list[FileFailure] = []

        def report(item: Prediction | FileFailure) -> None:
            (predictions if isinstance(item, Prediction) else errors).append(item)
            if on_result is not None:
                on_result(item)

        for err in expand_errors:
            report(FileFailure(err.path, str(err)))
        bar = _bar(len(paths), progress)
        chunks = [paths[i:i + batch_size] for i in range(0, len(paths), batch_size)]
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="edge-decode") as pool:
            pending = pool.submit(self._decode_chunk, chunks[0], max_pixels) if chunks else None
            for index in range(len(chunks)):
                decoded = pending.result()
                pending = pool.submit(self._decode_chunk, chunks[index + 1], max_pixels) \
                    if index + 1 < len(chunks) else None
                good = [(p, a, ms) for p, a, ms in decoded if isinstance(a, np.ndarray)]
                bad = {p: a for p, a, _ in decoded if not isinstance(a, np.ndarray)}
                probs, model_ms = None, 0.0
                if good:
                    t0 = time.perf_counter()
                    outputs = self.run(np.stack([a for _, a, _ in good]))
                    model_ms = (time.perf_counter() - t0) * 1000.0 / len(good)
                    probs = outputs.get("probs")
                    if probs is None:
                        probs = _softmax(outputs["logits"])
                    probs = probs.astype(np.float64)
                row = 0
                for path, array, ms in decoded:  # input order
                    if path in bad:
                        report(FileFailure(path, str(bad[path])))
                        continue
                    order = np.argsort(-probs[row], kind="stable")[:k]
                    report(Prediction(path=path, top_k=[(self.classes[i], float(probs[row, i])) for i in order],
                                      latency_ms=ms + model_ms, decode_ms=ms, model_ms=model_ms))
                    row += 1
                bar.update(len(decoded))
        bar.close()
        return InferResult(predictions=predictions, errors=errors, provider=self.provider, bundle=self.bundle.path,
                           round=self.bundle.round, lora=self.lora.to_json(), batch_size=batch_size,
                           seconds=time.perf_counter() - start, classes=list(self.classes),
                           runtime=self.engine.runtime, precision=self.engine.precision)

    def _decode_chunk(self, chunk: list[Path], max_pixels: int | None) -> list[tuple[Path, Any, float]]:
        out: list[tuple[Path, Any, float]] = []
        for path in chunk:
            try:
                array, ms = self.decode(path, max_pixels)
                out.append((path, array, ms))
            except ImageReadError as err:
                out.append((path, err, 0.0))
            except Exception as err:  # noqa: BLE001 - one bad file must never stop the others
                out.append((path, ImageReadError(path, f"unexpected {type(err).__name__}: {err}"), 0.0))
        return out


def infer_paths(paths: Iterable[str | os.PathLike], bundle: str | os.PathLike | Bundle | None = None, *,
                top_k: int = DEFAULT_TOP_K, batch_size: int = DEFAULT_BATCH_SIZE, provider: str = "auto",
                runtime: str = "ort", precision: str = "auto", threads: int | None = None,
                max_pixels: int | None = DEFAULT_MAX_PIXELS, progress: bool = False, personalised: bool = True,
                on_result: Callable[[Prediction | FileFailure], None] | None = None) -> InferResult:
    """Classify image files, directories (recursive) and glob patterns with a bundle.

    ``bundle``: directory (default ``./bundle``; `edge-client` passes ``$FEDMVP_BUNDLE``); verified before
    loading (``BundleError`` if tampered). ``provider``: auto | cpu | cuda | tensorrt
    (``ProviderError`` if a named one cannot load). ``runtime``: ort | openvino | auto, ``precision``: auto |
    fp32 | bf16 | fp16 | int8 (`Predictor`; a runtime named and missing: ``RuntimeUnavailable``).
    ``personalised=False`` runs the bundle's exported LoRA even where the device has a personalised one.
    Unreadable files are collected in ``result.errors``; ``on_result`` is called for each file as it finishes.
    """
    predictor = Predictor(bundle, provider=provider, threads=threads, personalised=personalised, runtime=runtime,
                          precision=precision)
    return predictor.infer(list(paths), top_k=top_k, batch_size=batch_size, max_pixels=max_pixels,
                           progress=progress, on_result=on_result)


def _identity(path: Path | None) -> tuple[int, int] | None:
    """The directory ``path`` names now (device, inode; links followed); None when there is none."""
    try:
        found = os.stat(path) if path is not None else None
    except OSError:
        return None
    return None if found is None else (found.st_dev, found.st_ino)


def _softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities for a model exported without a ``probs`` output (float64, stable)."""
    z = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _bar(total: int, progress: bool) -> Any:
    if not progress or total == 0:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="infer", unit="img", file=sys.stderr, leave=False, dynamic_ncols=True)
