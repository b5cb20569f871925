"""Image samples as torch datasets, skipping unreadable images with one warning per path.

Why two checks: a client's k-shot set is small, so it is verified eagerly when the client is
built (``ImageDataset.check`` / ``drop_unreadable``: every file decoded in full, as training decodes
it, bad files dropped) and training never meets a broken file. Test sets can be large (ImageNet val: 50k), so
they are checked lazily: ``__getitem__`` returns ``None`` for a file that fails to load and
``collate_samples`` leaves it out of the batch. Either way each bad path is reported once per
process (``UnreadableImageWarning`` naming the path) however often it is met.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Callable, Iterable, Sequence

import torch
from PIL import Image

from fedmvp_formats.folder_walk import regular_file_problem
from fedmvp_formats.shown import path_shown

Sample = tuple[str, int]
Transform = Callable[[Image.Image], Any]

_REPORTED: set[str] = set()
_LOCK = threading.Lock()


class UnreadableImageWarning(UserWarning):
    """An image file that cannot be decoded; it is skipped."""


def report_unreadable(path: str, error: BaseException | str) -> None:
    """Warn about ``path`` the first time only."""
    with _LOCK:
        if path in _REPORTED:
            return
        _REPORTED.add(path)
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    warnings.warn(f"skipping unreadable image {path_shown(path)}: {reason}", UnreadableImageWarning, stacklevel=3)


def decode_problem(path: str) -> str | None:
    """Why ``path`` does not decode as training decodes it (`load_rgb`, every pixel), or None.

    A full decode, not PIL's ``verify``: ``verify`` reads no JPEG data, so a truncated JPEG passed a
    check and was then dropped by training, and a site's counts disagreed with what it trained on."""
    try:
        load_rgb(path)
        return None
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError...
        return (str(exc).splitlines() or [""])[0] or type(exc).__name__


def is_readable(path: str) -> bool:
    """Whether ``path`` decodes in full as training decodes it (reports it once if not)."""
    problem = decode_problem(path)
    if problem is not None:
        report_unreadable(path, problem)
    return problem is None


def drop_unreadable(samples: Iterable[Sample]) -> list[Sample]:
    """``samples`` without the files that do not decode."""
    return [s for s in samples if is_readable(s[0])]


def load_rgb(path: str) -> Image.Image:
    """The image at ``path`` as RGB (palette, grey and RGBA images all become 3 channels); a FIFO or a
    device is refused from its ``stat``, never opened (an open would wait for a writer forever)."""
    problem = regular_file_problem(path)
    if problem is not None:
        raise OSError(problem)
    with Image.open(path) as img:
        return img.convert("RGB")


class ImageDataset(torch.utils.data.Dataset):
    """``(image, label, index)`` items over ``(path, label)`` samples.

    ``transform`` is open_clip's preprocess (PIL -> tensor); without one the PIL image is
    returned. An image that fails to load gives ``None`` (reported once); use
    ``collate_samples`` in the DataLoader to leave it out.
    """

    def __init__(self, samples: Sequence[Sample], transform: Transform | None = None) -> None:
        self.samples = list(samples)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int, int] | None:
        path, label = self.samples[index]
        try:
            image = load_rgb(path)
        except Exception as exc:
            report_unreadable(path, exc)
            return None
        return (self.transform(image) if self.transform else image), label, index

    def check(self) -> list[str]:
        """Verify every file now; drop the unreadable ones and return their paths."""
        kept = drop_unreadable(self.samples)
        good = set(kept)
        dropped = [p for p, y in self.samples if (p, y) not in good]
        self.samples = kept
        return dropped

    @property
    def labels(self) -> list[int]:
        return [y for _, y in self.samples]


def collate_samples(batch: list[tuple[torch.Tensor, int, int] | None]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DataLoader collate: stack images, labels, indices; items that failed to load are left out."""
    items = [b for b in batch if b is not None]
    if not items:
        return torch.empty(0), torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    images = torch.stack([b[0] for b in items])
    labels = torch.tensor([b[1] for b in items], dtype=torch.long)
    indices = torch.tensor([b[2] for b in items], dtype=torch.long)
    return images, labels, indices


def stack_samples(samples: Sequence[Sample], transform: Transform
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Load ``samples`` into one ``(images [N,3,H,W], labels [N])`` batch, skipping unreadable files.

    For small sets (a client's k shots) held in memory for the whole round.
    """
    dataset = ImageDataset(samples, transform)
    images, labels, _ = collate_samples([dataset[i] for i in range(len(dataset))])
    return images, labels
