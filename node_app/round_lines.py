"""The one line a site or device operator sees per message it answers (docs/tutorials/across-machines.md):
``round N: trained on K images (loss L, S s)``, ``round N: evaluated on K images (C correct, S s)``
or ``round N: refused train (why)``. Printed with ``MARK`` first, on the warm executor's output,
which `fedmvp join` and `edge-client join` show in place of Flower's log
(fedmvp_apps/deploy/node_lines.py). Only the deployed ClientApp says them: the simulation's sites
(`fedmvp train`) run ``fedmvp.federated.client_app`` directly, under its progress bar.
"""

from __future__ import annotations

import time
from typing import Callable

from flwr.app import Message

from fedmvp_formats import messages as schema
from fedmvp_formats.envelope import read_envelope

MARK = "[fedmvp] "  # fedmvp_apps.deploy.node_lines.MARK (this package may not import fedmvp_apps)


def _round(msg: Message) -> str:
    try:
        return str(schema.read_instruction(read_envelope(msg.content, msg.content.config_records)).round)
    except Exception:  # noqa: BLE001 - a message without a readable instruction is refused by its handler
        return "?"


def _metrics(reply: Message) -> dict:
    """The reply's ``metrics`` record ({} where it has none it can say: an error reply)."""
    if not reply.has_content():
        return {}
    try:
        records = read_envelope(reply.content, reply.content.config_records)
        return schema.read_metrics(records.get(schema.METRICS, {}))
    except schema.MessageError:
        return {}


def line(kind: str, msg: Message, reply: Message, seconds: float) -> str:
    """What the reply says of the round: images and loss (train), counts (evaluate)."""
    metrics = _metrics(reply)
    if kind == "train":
        return (f"round {_round(msg)}: trained on {metrics.get(schema.NUM_EXAMPLES, 0)} images "
                f"(loss {float(metrics.get(schema.TRAIN_LOSS, float('nan'))):.4f}, {seconds:.1f} s)")
    pairs = [schema.count_pair(metrics, name) for name in sorted(schema.count_sets(metrics))]
    correct, total = sum(p[0] for p in pairs if p), sum(p[1] for p in pairs if p)
    return f"round {_round(msg)}: evaluated on {total} images ({correct} correct, {seconds:.1f} s)"


def said(kind: str, msg: Message, handle: Callable[[], Message], started: float) -> Message:
    """``handle()``'s reply, its line printed; a refusal (the handler raised) printed as one line too."""
    try:
        reply = handle()
    except Exception as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        print(f"{MARK}round {_round(msg)}: refused {kind} ({first})", flush=True)
        raise
    print(f"{MARK}{line(kind, msg, reply, time.monotonic() - started)}", flush=True)
    return reply
