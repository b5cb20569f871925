"""The server modes by name: ``[server] mode`` selects the strategy that runs a run's rounds.

Every mode is a Flower ``Strategy`` built from the same ``StrategyOptions`` and the run's
``RoundWriter`` (``round_writer.py``: every round, version or ingest is written by it), and runs
through Flower's ``start`` signature. ``sync``: rounds with a barrier over sites and edge devices
(``strategy.py``); ``buffered``: versions written every ``buffer_size`` device updates (``buffered.py``).
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.serverapp.strategy import Strategy

from fedmvp.federated.buffered import BufferedStrategy
from fedmvp.federated.round_writer import RoundWriter
from fedmvp.federated.strategy import FedMVPStrategy
from fedmvp.federated.strategy_options import StrategyOptions

ServerMode = Callable[[StrategyOptions, RoundWriter], Strategy]

SERVER_MODES: dict[str, ServerMode] = {
    "sync": FedMVPStrategy,
    "buffered": BufferedStrategy,
}


def server_mode(name: str) -> ServerMode:
    """The strategy of ``[server] mode = name`` (the record's range check allows only registered names)."""
    try:
        return SERVER_MODES[name]
    except KeyError:
        raise ValueError(f"[server] mode {name!r} is not a server mode (known: {', '.join(sorted(SERVER_MODES))})") \
            from None
