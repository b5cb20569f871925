"""Dropouts and over-selection of edge devices (docs/howto/buffered.md, "Dropouts and over-selection").

Device fleets lose a share of the devices sent work (Bonawitz et al., "Towards federated learning at
scale", 2019: 6-10 % drop out; they over-select to 130 %). ``[server] over_selection`` says how many
devices are sent work per device wanted:

- a synchronous round sends its work to ``ceil(factor x wanted)`` edge devices (``sampling.over_selected``) and
  closes as soon as every sampled site answered and ``wanted`` devices replied (``RoundClose``); devices
  whose reply came later (or never came before the round closed) are *late*: recorded, said in a line,
  never averaged;
- buffered versions keep ``ceil(factor x concurrency)`` devices busy (``busy_devices``), so a device that
  vanished does not hold the buffer back; ``[server] min_buffer`` lets a version that has gathered for
  ``round_timeout`` be written with what arrived.

Under ``[privacy]`` with Poisson sampling no device is over-selected: discarding the late ones would change
each device's inclusion probability, which the accountant charges (docs/howto/privacy.md).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from typing import Any

from flwr.app import Message

from fedmvp.federated.flower_log import log_left_out
from fedmvp.federated.private_rounds import FIXED, Draw
from fedmvp.federated.sampling import edge_count


def busy_devices(concurrency: int, factor: float) -> int:
    """Buffered versions: devices kept training at once, ``ceil(factor x concurrency)``."""
    return math.ceil(round(factor * concurrency, 9))


def wanted_devices(draw: Draw, fraction: float, sent: int) -> int:
    """The devices a round wants out of the ``sent`` it drew: a seeded draw's fraction of its population
    (it sent more when over-selected), a Poisson draw all it drew."""
    return min(sent, edge_count(fraction, draw.population)) if draw.kind == FIXED else sent


def edge_name(node: int) -> str:
    """A device as state.json's ``timed_out`` and ``late`` name it."""
    return f"edge node {node}"


class RoundClose:
    """When an over-selected synchronous round has what it wants, and which device replies are late.

    ``messages``: the round's train messages (pushed: their ids known); ``edges``: the nodes among them
    that are edge devices; ``wanted``: the devices the round wants; ``needed``: usable replies the round
    needs in all (``min_nodes``). A reply counts when it is not an error reply (its checks come after)."""

    def __init__(self, messages: Iterable[Message], edges: Collection[int], wanted: int, needed: int):
        self.messages, self.edges = list(messages), set(edges)
        self.wanted, self.needed = wanted, needed
        self.late: list[int] = []
        self.sent: dict[str, int] | None = None  # message id -> its node, once the messages are pushed

    def _node(self, reply: Message) -> int:
        if self.sent is None:
            self.sent = {m.metadata.message_id: int(m.metadata.dst_node_id) for m in self.messages}
        return self.sent.get(reply.metadata.reply_to_message_id, int(reply.metadata.src_node_id))

    def enough(self, replies: list[Message]) -> bool:
        """Every site's node answered, ``wanted`` devices replied and at least ``needed`` replies came."""
        answered = {self._node(r) for r in replies}
        sites = {int(m.metadata.dst_node_id) for m in self.messages} - self.edges
        devices = sum(1 for r in replies if self._node(r) in self.edges and not r.has_error())
        usable = sum(1 for r in replies if not r.has_error())
        return sites <= answered and devices >= self.wanted and usable >= self.needed

    def split(self, replies: list[Message], round_number: int, factor: float) -> list[Message]:
        """The replies the round averages: device replies past the first ``wanted`` are late (in ``late``
        with the devices never heard from, each said in a line), dropped here."""
        kept, devices, self.late = [], 0, []
        for reply in replies:
            node = self._node(reply)
            if node in self.edges and not reply.has_error():
                devices += 1
                if devices > self.wanted:
                    self.late.append(node)
                    continue
            kept.append(reply)
        answered = {self._node(r) for r in replies}
        if devices >= self.wanted:  # closed early: who has not replied yet is late, not timed out
            self.late += [n for n in self.edges if n not in answered]
        self.late.sort()
        for node in self.late:  # one line each (``fedmvp serve`` echoes it)
            log_left_out(f"round {round_number}: {edge_name(node)} discarded as late: the round had its "
                         f"{self.wanted} device replies (over_selection {factor:g})")
        return kept

    def record(self, replies: list[Message], timed_out: list[str]
               ) -> tuple[list[str], list[str], dict[str, Any]]:
        """(state.json ``timed_out`` without the late devices, ``late``, ``devices``: selected, wanted,
        replied, late, timed_out counts)."""
        late = [edge_name(n) for n in self.late]
        timed_out = [name for name in timed_out if name not in late]
        replied = sum(1 for r in replies if self._node(r) in self.edges)
        return timed_out, late, devices_record(len(self.edges), self.wanted, replied, len(self.late),
                                         sum(1 for name in timed_out if name.startswith("edge node ")))


def devices_record(selected: int, wanted: int, replied: int, late: int, timed_out: int,
                   **more: Any) -> dict[str, Any]:
    """state.json ``devices``: edge devices sent work, wanted, that replied, discarded late, timed out."""
    return {"selected": selected, "wanted": wanted, "replied": replied, "late": late, "timed_out": timed_out,
            **more}
