"""What a folder of labelled images is, for a site (``fedmvp.data.site_folder``) and an edge device
(``edge_client.local_data``) alike: the image files read, and the stable held-out share.

One definition, so a site's folder trains and evaluates as a device's does and an image a device
classifies is one a site can train on (docs/architecture.md "Records that travel"). Standard
library only (the leaf).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable

# The files every reader promises to read: the edge client's inference, its training and a site's.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".bmp", ".gif", ".webp",
                    ".tif", ".tiff", ".ppm", ".pgm", ".pbm", ".pnm")


def is_image_name(name: str) -> bool:
    """A non-hidden file name with a known image extension."""
    return name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith(".")


def stable_order(names: Iterable[str]) -> list[str]:
    """``names`` in the order of their sha256: the order the held-out share is cut from."""
    return sorted(set(names), key=lambda n: hashlib.sha256(n.encode()).hexdigest())


def held_out(names: Iterable[str], fraction: float) -> set[str]:
    """The held-out share of ONE class's files (``names``: paths relative to the folder's root):
    the first ``ceil(fraction * n)`` in the order of their sha256, none of a class with one image.

    Stable by name, not by the order a listing returned them or by a seed: the same folder gives the
    same split every round, on every restart and on every machine."""
    ordered = stable_order(names)
    cut = math.ceil(fraction * len(ordered)) if len(ordered) > 1 else 0
    return set(ordered[:cut])
