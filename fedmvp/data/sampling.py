"""Sample-level selection: k-shot sets, Dirichlet label skew, per-class hold-out splits.

Why seeds per class: each class draws from its own ``random.Random(f"{seed}:{label}")`` over
its paths sorted by name, so a class's shots depend only on (seed, label, its files): not on
the order a directory listing or dict returned them, nor on which other classes are present.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from typing import Callable, Iterable, Sequence

import numpy as np

Sample = tuple[str, int]


def by_label(samples: Iterable[Sample]) -> dict[int, list[str]]:
    """Sorted, de-duplicated paths per label."""
    groups: dict[int, set[str]] = defaultdict(set)
    for path, label in samples:
        groups[label].add(path)
    return {label: sorted(groups[label]) for label in sorted(groups)}


def k_shot(samples: Iterable[Sample], k: int, seed: int,
           keep: Callable[[str], bool] | None = None) -> list[Sample]:
    """``k`` samples per class (all of a class with fewer), grouped by label in label order.

    ``keep`` (e.g. ``dataset.is_readable``) rejects a pick, and the next one in the class's
    shuffled order takes its place, so a broken file does not cost a shot.
    """
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    picked: list[Sample] = []
    for label, paths in by_label(samples).items():
        order = list(paths)
        random.Random(f"{seed}:{label}").shuffle(order)
        taken = 0
        for path in order:
            if taken == k:
                break
            if keep is None or keep(path):
                picked.append((path, label))
                taken += 1
    return picked


def dirichlet_label_skew(samples: Sequence[Sample], num_clients: int, alpha: float, seed: int,
                         min_per_client: int = 1, max_tries: int = 1000) -> list[list[Sample]]:
    """Split ``samples`` over ``num_clients`` with per-class proportions ~ Dir(alpha).

    Small ``alpha`` gives each client few classes; large ``alpha`` approaches an even split.
    Draws are repeated (deterministically) until every client has ``min_per_client`` samples.
    """
    if num_clients < 1 or alpha <= 0:
        raise ValueError(f"need num_clients >= 1 and alpha > 0, got {num_clients}, {alpha}")
    groups = by_label(samples)
    if sum(len(p) for p in groups.values()) < num_clients * min_per_client:
        raise ValueError(f"{len(samples)} samples cannot give {num_clients} clients "
                         f"{min_per_client} each")
    rng = np.random.default_rng(seed)
    for _ in range(max_tries):
        shares: list[list[Sample]] = [[] for _ in range(num_clients)]
        for label, paths in groups.items():
            order = [paths[i] for i in rng.permutation(len(paths))]
            props = rng.dirichlet(np.full(num_clients, float(alpha)))
            cuts = (np.cumsum(props)[:-1] * len(order)).astype(int)
            for client, part in enumerate(np.split(np.array(order, dtype=object), cuts)):
                shares[client].extend((str(p), label) for p in part)
        if min(len(s) for s in shares) >= min_per_client:
            return [sorted(s, key=lambda s: (s[1], s[0])) for s in shares]
    raise ValueError(f"Dirichlet(alpha={alpha}) left a client with fewer than {min_per_client} "
                     f"samples in {max_tries} draws; raise alpha or use fewer clients")


def holdout_split(samples: Iterable[Sample], fraction: float, seed: int
                  ) -> tuple[list[Sample], list[Sample]]:
    """``(rest, held_out)``: ``ceil(fraction * n)`` random images per class held out.

    For layouts without a test split (DomainBed), the held-out part is the local test set.
    """
    if not 0 <= fraction < 1:
        raise ValueError(f"hold-out fraction must be in [0, 1), got {fraction}")
    rest: list[Sample] = []
    held: list[Sample] = []
    for label, paths in by_label(samples).items():
        order = list(paths)
        random.Random(f"holdout:{seed}:{label}").shuffle(order)
        n = math.ceil(fraction * len(order)) if len(order) > 1 else 0
        held.extend((p, label) for p in sorted(order[:n]))
        rest.extend((p, label) for p in sorted(order[n:]))
    return rest, held
