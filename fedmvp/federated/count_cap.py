"""How much one update may weigh, whatever it claims: example counts capped at a multiple of the round's median.

FedAvg and the weighted robust rules (docs/howto/robust.md) weigh an update by its example count, and a
device's or a ``[federation]`` site's count is its own claim, bounded only by ``edge_max_examples`` /
``site_max_examples``. One sender of ten sending a sign-flipped delta just under a norm bound and claiming
the largest count accepted reversed a round's step. So every round weighs an update's examples as at most
``[server] count_cap`` times the median count of the round's updates (``statistics.median``: the mean of
the two middle counts for an even number): with 3 (the default) and ten updates, one claims at most
3/12 of the round (docs/security.md "Replayed and duplicated updates"). A k-shot federation's sites hold
about the same number of images, so the cap changes nothing there; where honest sites differ by more, raise
it or set it to 0 (no cap). A round where the cap changed a weight records it in state.json
(``count_cap``: the factor, the median, the cap and whom it capped); the factor is in the run's server record.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

from fedmvp.federated.aggregate import Update


def cap_counts(updates: Sequence[Update], factor: float | None, senders: Sequence[tuple[Any, str]] = ()
               ) -> tuple[list[Update], dict[str, Any] | None]:
    """``updates`` with each example count capped at ``factor`` times their median, and the record of it
    (None: no cap, ``factor`` 0 or None, or fewer than two updates). ``senders``: per update its node (an update
    file: its name) and role, which name the capped ones."""
    if not factor or len(updates) < 2:
        return list(updates), None
    median = float(statistics.median(u.examples for u in updates))
    cap = factor * median
    capped = []
    out = []
    for i, update in enumerate(updates):
        if update.examples > cap:
            node, role = senders[i] if i < len(senders) else (i, None)
            capped.append({"node": node, "role": role, "examples": update.examples})
            update = dataclasses.replace(update, examples=cap)
        out.append(update)
    return out, {"factor": factor, "median": median, "cap": cap, "capped": capped}
