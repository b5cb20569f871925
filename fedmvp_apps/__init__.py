"""fedmvp_apps: the top layer, the programs people run (docs/architecture.md "Layers").

The `fedmvp`, `fedmvp-export` and `edge-client` commands (``cli``, ``export_cli``, ``edge_cli``),
`fedmvp serve` and both joins (``deploy``: the SuperLink, the one SuperNode launch, certificates,
the Flower app folder; ``edge_join``). An app may import every library below it (``fedmvp``,
``export``, ``edge_client``, ``fedmvp_formats``); no library imports an app.

This ``__init__`` imports nothing: the `edge-client` console script imports it on an edge install
that has no torch, open_clip or training core.
"""
