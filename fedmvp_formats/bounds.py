"""Bounds on the numbers a sender reports about itself (losses, seconds): one definition for the update
file (``fedmvp_formats.update``) and a reply's metrics (``fedmvp_formats.messages``).

Finite is not enough: 1e308 is finite, an example-weighted mean of it is not, and ``Infinity`` is no JSON
(state.json, metrics.jsonl and metrics.csv would hold it). No training's loss, CE + alpha * L_con
(docs/method.md §5), comes near ``MAX_LOSS``; ``MAX_SECONDS`` is about 116 days.
"""

from __future__ import annotations

MAX_LOSS = 1e6
MAX_SECONDS = 1e7
