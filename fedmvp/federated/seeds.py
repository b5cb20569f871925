"""Seeds derived from (run seed, round, client, ...), with no Flower import: local training (which
must run where flwr is absent, e.g. the benchmarks on a GPU machine) and the server share it."""
from __future__ import annotations

import hashlib


def derived_seed(*parts: object) -> int:
    """A stable 63-bit seed from (run seed, round, client, ...): resume replays the same randomness."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
