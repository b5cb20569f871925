"""Which pictures a bundle ships as its check images (``edge_client/check_images.py`` holds the format).

Why: `edge-client --runtime auto` verifies each runtime and precision against the bundle's fp32 on them
(docs/architecture.md, "Runtimes"), and verification means something only on pictures like a device's:
on synthetic colour fields every logit is near-tied. The exporter already chose real images for its
parity check (``export.run_inputs.export_images``: ``--images``, else the run's recorded test images),
so the first CHECK_COUNT of those travel. They are recovered as uint8 from the normalised parity
tensors (ToTensor divided uint8 by 255, so the inverse is exact; a round trip checks it), which is what
the device normalises again. Privacy: these are the exporting machine's test images; ``--no-check-images``
ships generated colour fields instead (docs/howto/check-images.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from edge_client.check_images import CHECK_COUNT, colour_fields
from edge_client.preprocess import PreprocessSpec, normalise
from export.errors import ExportError

GENERATED_SEED = 0  # the colour fields an export ships when no real picture may or can travel
SOURCES = {"folder": "images", "run": "run-test"}  # ExportImages.note's kind -> the manifest's source
LAYOUT = "uint8 RGB [N, S, S, 3] after resize and crop; the device normalises by preprocess"


@dataclass(frozen=True)
class ShippedCheck:
    """The check images a bundle carries: uint8 [N, S, S, 3], their source and how many are generated."""

    pixels: np.ndarray
    source: str
    generated: int

    def manifest(self, file: str) -> dict[str, object]:
        """The manifest's ``check_images`` section."""
        return {"file": file, "source": self.source, "images": len(self.pixels), "generated": self.generated,
                "layout": LAYOUT}

    def line(self) -> str:
        """What travels, said once at export (a clinic's test images are personal data)."""
        if self.source == "generated":
            return f"check images: {len(self.pixels)} generated colour fields (no test image in the bundle)"
        what = "of the run's test images" if self.source == "run-test" else "of the --images pictures"
        return (f"check images: {len(self.pixels) - self.generated} {what} travel in the bundle "
                f"(check_images.safetensors, for edge-client --runtime auto); --no-check-images keeps them here")


def generated(spec: PreprocessSpec, count: int = CHECK_COUNT) -> ShippedCheck:
    """Colour fields only: no picture of the exporting machine travels."""
    return ShippedCheck(colour_fields(GENERATED_SEED, count, spec.image_size), "generated", count)


def from_parity(images: torch.Tensor, note: dict[str, int], spec: PreprocessSpec,
                count: int = CHECK_COUNT) -> ShippedCheck:
    """The first ``count`` real parity images (they come first, ``export.run_inputs.topped_up``), as uint8,
    topped up with colour fields where fewer are real. ``note``: ExportImages.note ({kind: real, synthetic})."""
    kind = next((k for k in note if k in SOURCES), None)
    real = min(count, note.get(kind, 0)) if kind else 0
    if real == 0:
        return generated(spec, count)
    pixels = to_uint8(images[:real], spec)
    fields = colour_fields(GENERATED_SEED, count - real, spec.image_size) if real < count else pixels[:0]
    return ShippedCheck(np.concatenate([pixels, fields]), SOURCES[kind], count - real)


def to_uint8(images: torch.Tensor, spec: PreprocessSpec) -> np.ndarray:
    """Normalised [N, 3, S, S] -> uint8 [N, S, S, 3], checked to normalise back to the same tensors."""
    x = images.detach().cpu().double().numpy().transpose(0, 2, 3, 1)
    mean, std = np.asarray(spec.mean, dtype=np.float64), np.asarray(spec.std, dtype=np.float64)
    pixels = np.clip(np.rint((x * std + mean) * 255.0), 0, 255).astype(np.uint8)
    worst = float(np.max(np.abs(normalise(pixels, spec) - images.detach().cpu().numpy())))
    if worst > 1e-4:  # a grey level is ~0.015 after normalisation: these were not pictures
        raise ExportError(f"check images: the parity images are not pictures normalised by the bundle's "
                          f"preprocess (off by {worst:.3g} after a uint8 round trip)")
    return pixels
