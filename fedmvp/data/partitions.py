"""Class-level partitions (docs/method.md §6), pure functions on label lists.

Why pure: the paper's client table (9 datasets -> 30 clients) and every preset's coverage can
be checked from class counts alone, before any image is listed.
"""

from __future__ import annotations

import math
from typing import Sequence


def split_base_new(num_classes: int, base: int | None = None, new: int | None = None
                   ) -> tuple[list[int], list[int]]:
    """``(base, new)`` labels: base = the first ``base`` (default ceil(C/2)), new = the next ``new``
    (default: all the rest)."""
    base = math.ceil(num_classes / 2) if base is None else base
    if not 1 <= base <= num_classes:
        raise ValueError(f"base_classes must be in 1..{num_classes}, got {base}")
    rest = num_classes - base
    new = rest if new is None else new
    if not 0 <= new <= rest:
        raise ValueError(f"new_classes must be in 0..{rest} ({num_classes} classes, {base} base), "
                         f"got {new}")
    return list(range(base)), list(range(base, base + new))


def contiguous_clients(labels: Sequence[int], per_client: int, num_clients: int | None = None
                       ) -> list[list[int]]:
    """Contiguous, disjoint chunks of ``per_client`` labels.

    Without ``num_clients``, every label gets a client: a trailing remainder of at most half a
    client joins the previous chunk, a larger one is its own client (50 -> 20+30, 51 -> 20+20+11,
    which gives the paper's 2,3,2,3,1,3,1,5,10 = 30 clients). With ``num_clients`` exactly that
    many chunks of ``per_client`` are cut (labels beyond them land in no client; see ``uncovered``).
    """
    if per_client < 1:
        raise ValueError(f"classes_per_client must be at least 1, got {per_client}")
    labels = list(labels)
    chunks = [labels[i:i + per_client] for i in range(0, len(labels), per_client)]
    if num_clients is not None:
        if num_clients < 1:
            raise ValueError(f"num_clients must be at least 1, got {num_clients}")
        if num_clients > len(chunks):
            raise ValueError(f"{num_clients} clients of {per_client} classes need "
                             f"{num_clients * per_client} classes, there are {len(labels)}")
        return chunks[:num_clients]
    if len(chunks) > 1 and len(chunks[-1]) <= per_client / 2:
        chunks[-2].extend(chunks.pop())
    return chunks


def uncovered(labels: Sequence[int], groups: Sequence[Sequence[int]]) -> list[int]:
    """Labels that are in no group."""
    covered = {y for g in groups for y in g}
    return [y for y in labels if y not in covered]


def groups_from_names(clients: Sequence[Sequence[str]], class_names: Sequence[str]) -> list[list[int]]:
    """Explicit client class lists (names) as label lists; unknown or repeated names are errors."""
    label_of = {n: i for i, n in enumerate(class_names)}
    unknown = [n for g in clients for n in g if n not in label_of]
    if unknown:
        raise ValueError(f"clients name unknown classes: {', '.join(unknown[:5])}")
    seen: set[str] = set()
    repeated = [n for g in clients for n in g if n in seen or seen.add(n)]
    if repeated:
        raise ValueError(f"classes in more than one client: {', '.join(repeated[:5])}")
    empty = [i for i, g in enumerate(clients) if not g]
    if empty:
        raise ValueError(f"clients without classes: {', '.join(map(str, empty))}")
    return [[label_of[n] for n in g] for g in clients]
