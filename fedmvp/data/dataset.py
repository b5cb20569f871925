"""Image samples as torch datasets, skipping unreadable images with one warning per path.

Why two checks: a client's k-shot set is small, so it is verified eagerly when the client is
built (``ImageDataset.check`` / ``drop_unreadable``: every file decoded in full, as training decodes
it, bad files dropped) and training never meets a broken file. Test sets can be large (ImageNet val: 50k), so
they are checked lazily: ``__getitem__`` returns ``None`` for a file that fails to load and
``collate_samples`` leaves it out of the batch. Either way each bad path is reported once per
process (``UnreadableImageWarning`` naming the path) however often it is met.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from fedmvp.data.image_decode import (  # noqa: F401 - one definition each, used by the datasets below
    Sample, Transform, UnreadableImageWarning, decode_problem, drop_unreadable, is_readable, load_rgb,
    report_unreadable)


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
