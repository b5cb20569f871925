"""Buffered asynchronous versions for edge devices (FedBuff; docs/architecture.md "Buffered versions for devices").

Flower 1.42 has no asynchronous aggregation, but its ``Grid`` pushes and pulls messages one by one,
so the server can keep ``concurrency`` devices busy without a barrier: whenever a device is free it
is sent the newest version; every reply is checked as a synchronous round's would be
(``replies.check_reply``, against the version the device was sent) and turned into a *delta*
against that version's LoRA; as soon as ``buffer_size`` accepted deltas have arrived the next
version is written by the server's one update rule (``aggregate.apply_updates``, docs/method.md §6):

    theta <- theta + server_lr * sum_i n_i s(t_i) Delta_i / sum_i n_i,   s(t) = (1 + t)^(-a)

with ``t`` the versions written since the device's base (its staleness), ``a`` the
``staleness_exponent`` and ``n_i`` its examples; ``[privacy]`` central mode clips and noises the LoRA's
step there, each version charged to the budget with q = 1 (devices are not sampled by the server,
as for `fedmvp ingest`). Under ``[privacy]`` a version holds at most one update per device: the noise
z C / m is calibrated to one device's share C / m, so a fast device that replied again waits, its
update buffered, until the version is written, and is sent no work meanwhile (docs/howto/privacy.md).
A reply staler than ``max_staleness`` is left out (a line, and the version's ``rejected`` and ``devices``
``stale`` say it). A device that never answers (killed, offline) is forgotten after ``round_timeout``: its
message changes nothing. ``over_selection`` keeps ``ceil(factor x concurrency)`` devices busy, and a version
that has gathered for ``round_timeout`` is written with ``min_buffer`` or more updates
(``dropouts``, docs/howto/buffered.md "Dropouts and over-selection"); each version records its
``devices``: sent work, replied, taken, stale, timed out. Each version is a checkpoint like a round
(atomic, resumable, recorded with every reply's base, t, s(t) and weight); a resumed server starts from
the last one, and devices that were mid-update are simply sent the newest version again.

Nothing here waits on one node: a node not met yet is sent its identify query and the loop goes on
(``_ask``; the answer is pulled with the replies), and replies are pulled by ``reply_pulls`` (one request
a poll for all of them; a reply whose upload is late holds up only itself).

Only edge devices train here (they train the LoRA alone, so the PromptFormer stays the run's);
sites keep synchronous rounds (``mode = "sync"``) and evaluate each due version where their data is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from logging import INFO, WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.supercore import log

from fedmvp_formats import messages as schema
from fedmvp_formats.names import LORA_PREFIX
from fedmvp_formats.promptformer import promptformer_digest

from fedmvp.federated.aggregate import Update
from fedmvp.federated.dropouts import busy_devices, devices_record
from fedmvp.federated.private_rounds import BUFFERED, Draw
from fedmvp.federated.replies import ReplyRules, check_reply, reply_fields
from fedmvp.federated.reply_pulls import SeparatePulls, reply_pulls
from fedmvp.federated.round_writer import RoundFailed, RoundWriter
from fedmvp.federated.strategy import FedMVPStrategy, StrategyOptions, cosine_lr
from fedmvp.federated.wire import array_record, instruction_content, numpy_state

POLL_SECONDS = (0.05, 0.25)  # first and longest pause between two pulls when nothing arrived


@dataclass(frozen=True)
class Contribution:
    """One accepted reply: the LoRA it trained, the version it started from and what weighs it."""

    node: int
    base: int  # the version the device was sent
    staleness: int  # versions written since its base (counted again when the delta is used)
    examples: int
    arrays: dict[str, np.ndarray]
    loss: float
    bundle_id: str


@dataclass
class Pending:
    """A train message out at a device."""

    node: int
    base: int
    sent: float


@dataclass
class Asking:
    """An identify query out at a node not met yet (``NodeRegistry.identify_messages``)."""

    node: int
    round: int
    nonce: str
    sent: float


class BufferedStrategy(FedMVPStrategy):
    """[server] mode = "buffered": the strategy's registry, reply rules and round writer, with versions
    written every ``buffer_size`` device updates instead of rounds with a barrier (``start``)."""

    def __init__(self, options: StrategyOptions, writer: RoundWriter | None = None,
                 sleep: Callable[[float], None] = time.sleep):
        super().__init__(options, writer)
        self.server, self.sleep = self.policy.server, sleep
        self.pulls: SeparatePulls | None = None  # awaited replies, one request a poll (reply_pulls.py)
        self.pending: dict[str, Pending] = {}  # message id -> what it carried
        self.asking: dict[str, Asking] = {}  # identify message id -> the node asked (answered in ``_receive``)
        self.served: dict[int, int] = {}  # node -> train messages sent (the least served is sent first)
        self.bases: dict[int, dict[str, np.ndarray]] = {}  # version -> its LoRA (kept while a delta needs it)
        self.buffer: list[Contribution] = []
        self.population = 0  # edge devices connected at the last send (recorded with a private version)
        self.timed_out: list[str] = []  # devices whose message expired since the last version
        self.began = time.monotonic()  # when the version being gathered began
        self.busy = busy_devices(self.server.concurrency, self.server.over_selection)  # devices kept training
        self.counts = {"selected": 0, "replied": 0, "stale": 0}  # since the last version (its ``devices``)

    # ---- one version's LoRA and who may be sent it ------------------------------------------------------
    def _lora(self, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in state.items() if k.startswith(LORA_PREFIX)}

    def _send(self, grid: Grid, state: dict[str, np.ndarray], version: int) -> None:
        """The newest version to free devices, up to ``concurrency`` out at once (least served first)."""
        connected = sorted(grid.get_node_ids())
        self._ask(grid, connected, version + 1)  # new nodes asked who they are; their answers come later
        busy = {p.node for p in self.pending.values()} | self._waiting()
        free = sorted((n for n in self.registry.edges(connected) if n not in busy),
                      key=lambda n: (self.served.get(n, 0), n))
        room = max(0, self.busy - len(self.pending))
        self.population = len(self.registry.edges(connected))
        if not free or not room:
            return
        digest = promptformer_digest(state)
        instruction = self._instruction(
            version + 1, promptformer_digest=digest, lr=cosine_lr(self.base_lr, version + 1, self.total_rounds),
            lora_clients=tuple(sorted(self.lora_clients)), local=self.client_config.get("local"),
            privacy=self.privacy.record() if self.privacy else None)
        full = instruction_content(array_record(state), instruction, ConfigRecord())
        lora = instruction_content(array_record(self._lora(state)), instruction, ConfigRecord())
        messages = [Message(content=lora if self.holds(node, digest) else full, message_type=MessageType.TRAIN,
                            dst_node_id=node) for node in free[:room]]
        now = time.monotonic()
        for node, message_id in zip(free[:room], grid.push_messages(messages)):
            if message_id:
                self.pending[message_id] = Pending(node, version, now)
                self.served[node] = self.served.get(node, 0) + 1
                self.counts["selected"] += 1
        self.bases.setdefault(version, self._lora(state))

    def _ask(self, grid: Grid, connected: list[int], round_number: int) -> None:
        """Nodes not met yet asked who they are *without waiting* (a synchronous round waits, ``_learn``):
        the answers arrive with the train replies (``_receive``), so a node slow to answer, or gone before
        it did, holds up no device; one unanswered within ``round_timeout`` is asked again."""
        asked = {a.node for a in self.asking.values()}
        nodes = [n for n in self.registry.unknown(connected) if n not in asked]
        if not nodes:
            return
        messages, nonce = self.registry.identify_messages(nodes, self._instruction(round_number))
        now = time.monotonic()
        for node, message_id in zip(nodes, grid.push_messages(messages)):
            if message_id:
                self.asking[message_id] = Asking(node, round_number, nonce, now)

    def _waiting(self) -> set[int]:
        """[privacy]: the devices whose update waits in the buffer (one per device a version; none without)."""
        return {c.node for c in self.buffer} if self.privacy is not None else set()

    # ---- what comes back -----------------------------------------------------------------------------
    def _receive(self, grid: Grid, state: dict[str, np.ndarray], version: int) -> int:
        """Pull whatever replies arrived; check each and buffer its delta. Returns how many arrived."""
        if not self.pending and not self.asking:
            return 0
        replies = self.pulls.poll([*self.pending, *self.asking])
        for msg in replies:
            asked = self.asking.pop(msg.metadata.reply_to_message_id, None)
            if asked is not None:  # an identity: the node may be sent work from the next send on
                self.registry.hear([msg], asked.round, asked.nonce)
                self._sync_sites()
                continue
            sent = self.pending.pop(msg.metadata.reply_to_message_id, None)
            if sent is not None:
                self.counts["replied"] += 1
                self._take(msg, sent, state, version)
        return len(replies)

    def _take(self, msg: Message, sent: Pending, state: dict[str, np.ndarray], version: int) -> None:
        node = sent.node
        if msg.has_error():
            return self._leave_out(version, node, f"the device failed: {msg.error.reason}")
        fields = reply_fields(msg.content)
        if isinstance(fields, str):
            return self._leave_out(version, node, fields)
        arrays, metrics = fields
        base_state = {**state, **self.bases[sent.base]}  # checked against what the device was sent
        verdict = check_reply(arrays, metrics, rules=ReplyRules(run_id=self.run_id, round=sent.base + 1,
                                                                server=self.server,
                                                                classes_digest=self.classes_digest),
                              global_state=base_state, expected_names={}, declared_examples={},
                              site_names=self.site_names, class_rules=self.class_rules)
        if verdict.accepted and verdict.role != schema.EDGE:
            verdict.arrays, verdict.reason = None, "a site's reply in a buffered run (only edge devices train here)"
        if not verdict.accepted:
            self.known.pop(node, None)
            return self._leave_out(version, node, verdict.reason or "rejected")
        if self._too_stale(node, sent.base, version):
            return
        identity = verdict.identity
        self.known[node] = {schema.ROLE: schema.EDGE, schema.BUNDLE_ID: identity.bundle_id,
                                schema.PROMPTFORMER_DIGEST: identity.promptformer_digest}
        self.buffer.append(Contribution(node, sent.base, version - sent.base, int(metrics[schema.NUM_EXAMPLES]),
                                        verdict.arrays, float(metrics.get(schema.TRAIN_LOSS, float("nan"))),
                                        str(identity.bundle_id or "")))

    def _split(self) -> tuple[list[Contribution], list[Contribution]]:
        """(the next version's updates, at most ``buffer_size``, the ones that stay buffered): the oldest
        first, and under [privacy] at most one per device (a second waits for the version after)."""
        taken: list[Contribution] = []
        rest: list[Contribution] = []
        for c in self.buffer:
            one_each = self.privacy is None or all(t.node != c.node for t in taken)
            (taken if len(taken) < self.server.buffer_size and one_each else rest).append(c)
        return taken, rest

    def _too_stale(self, node: int, base: int, version: int) -> bool:
        """Whether a delta based on ``base`` is beyond ``max_staleness`` for the version after
        ``version`` (left out, with a line)."""
        staleness = version - base
        if staleness <= self.server.max_staleness:
            return False
        self.counts["stale"] += 1
        self._leave_out(version, node, f"based on version {base}, {staleness} versions behind (max_staleness "
                                    f"{self.server.max_staleness})")
        return True

    def _leave_out(self, version: int, node: int, reason: str) -> None:
        log(WARNING, "version %s: reply of node %s (edge device) left out: %s", version + 1, node, reason)
        self.rejected.append({"node": node, "site": None, "reason": reason, "role": schema.EDGE})

    def _expire(self, version: int) -> None:
        """Forget messages out longer than ``round_timeout``: the device is gone; its base is freed."""
        now = time.monotonic()
        for message_id, asked in list(self.asking.items()):
            if now - asked.sent > self.server.round_timeout:
                del self.asking[message_id]  # asked again at the next send
        for message_id, sent in list(self.pending.items()):
            if now - sent.sent > self.server.round_timeout:
                del self.pending[message_id]
                self.timed_out.append(f"edge node {sent.node}")
                self._leave_out(version, sent.node, f"no reply within round_timeout {self.server.round_timeout:g} s")

    # ---- the versions -----------------------------------------------------------------------------------
    def _due(self) -> int:
        """Updates the version being gathered is written with now: ``buffer_size`` once that many are
        buffered; after ``round_timeout`` seconds ``min_buffer`` (``dropouts``); 0: not yet."""
        if len(self.buffer) >= self.server.buffer_size:
            return self.server.buffer_size
        least = self.server.min_buffer
        waited = time.monotonic() - self.began >= self.server.round_timeout
        return least if least is not None and waited and len(self.buffer) >= least else 0

    def _write(self, grid: Grid, state: dict[str, np.ndarray], version: int, need: int) -> dict[str, np.ndarray]:
        """The next version from the buffer (``need`` to ``buffer_size`` deltas), written by the run's
        ``RoundWriter``."""
        # Staleness is counted when the delta is used: a reply that waited in the buffer got staler.
        self.buffer = [replace(c, staleness=version - c.base) for c in self.buffer
                       if not self._too_stale(c.node, c.base, version)]
        if len(self.buffer) < need:
            return state
        taken, rest = self._split()
        if len(taken) < need:  # [privacy]: too few different devices yet
            return state
        self.buffer = rest
        # Arrival order must not change a bit: the deltas are summed by base version, bundle and node.
        taken.sort(key=lambda c: (c.base, c.bundle_id, c.node))
        charged = self.writer.charge(1.0, version + 1)  # devices are not sampled by the server: q = 1
        step = self.writer.apply(f"version {version + 1}", state, [
            Update(c.arrays, c.examples, c.staleness, self.bases[c.base]) for c in taken],
            [(c.node, schema.EDGE) for c in taken])
        new = {**state, **step.tensors}
        total = sum(c.examples for c in taken)
        summary = {"train-loss": sum(c.loss * c.examples for c in taken) / total, "train-ce": float("nan"),
                   "train-consistency": float("nan"), "clients": len(taken), "lora-clients": len(self.lora_clients),
                   "edges": len(taken)}
        released = self.writer.released(  # who was in it recorded: at most one update per device (``_split``)
            charged, step, version + 1, Draw(BUFFERED, self.population),
            [(c.node, schema.EDGE, None, list(c.arrays)) for c in taken])
        record = self._record(version + 1, summary, released, replies=[
            {"node": c.node, "role": schema.EDGE, "examples": c.examples, "loss": c.loss, "bundle_id": c.bundle_id,
             "base": c.base, **weight} for c, weight in zip(taken, step.weights)],
            screened=self.writer.screened(step))
        record.timed_out, record.seconds = list(self.timed_out), time.monotonic() - self.began
        record.devices = devices_record(self.counts["selected"], self.server.buffer_size, self.counts["replied"], 0,
                                        len(self.timed_out), taken=len(taken), stale=self.counts["stale"],
                                        closed="buffer_size" if need == self.server.buffer_size else "min_buffer")
        self.counts = dict.fromkeys(self.counts, 0)
        self.rejected, self.timed_out = [], []
        self.global_state = new
        self.close_round(grid, record, new)
        self.began = time.monotonic()
        log(INFO, "version %s written from %s device updates (staleness %s)%s", version + 1, len(taken),
            [c.staleness for c in taken], "" if need == self.server.buffer_size else
            f", after round_timeout {self.server.round_timeout:g} s with min_buffer {need}")
        return new

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float | None = None,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Flower's ``Strategy.start`` for buffered versions: versions ``round_offset + 1`` ..
        ``round_offset + num_rounds``, each evaluated when due and saved (``close_round``); ``evaluate_fn``
        is called before the first version, as Flower calls it. RoundFailed when no device is connected
        for ``node_wait`` seconds or a version would hold non-finite values."""
        result = Result(arrays=initial_arrays)
        if evaluate_fn is not None and (res := evaluate_fn(0, initial_arrays)) is not None:
            result.evaluate_metrics_serverapp[0] = res
        self.pulls = reply_pulls(grid, self.busy)
        log(INFO, "buffered versions: replies pulled by %s", type(self.pulls).__name__)
        try:
            state = self._versions(grid, initial_arrays, self.round_offset, self.round_offset + num_rounds)
        finally:
            self.pulls.close()
        result.arrays = array_record(state)
        return result

    def _versions(self, grid: Grid, initial: ArrayRecord, start: int, total: int) -> dict[str, np.ndarray]:
        state, version = numpy_state(initial), start
        self.global_state, self.began = state, time.monotonic()
        idle_since, pause = time.monotonic(), POLL_SECONDS[0]
        while version < total:
            self._send(grid, state, version)
            arrived = self._receive(grid, state, version)
            self._expire(version)
            while (need := self._due()) and version < total:
                written = self._write(grid, state, version, need)
                if written is state:  # stale deltas were dropped: the buffer is short again
                    break
                state, version = written, version + 1
            held = {version} | {p.base for p in self.pending.values()} | {c.base for c in self.buffer}
            self.bases = {v: lora for v, lora in self.bases.items() if v in held}  # a base while a delta needs it
            if self.pending or arrived:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > self.server.node_wait and self._waiting():  # [privacy]
                raise RoundFailed(f"version {version + 1}: only {len({c.node for c in self.buffer})} different "
                                  f"devices sent an update within node_wait {self.server.node_wait:g} s; under "
                                  f"[privacy] a version takes one update per device, buffer_size "
                                  f"{self.server.buffer_size} of them: connect more devices or lower buffer_size")
            elif time.monotonic() - idle_since > self.server.node_wait:
                raise RoundFailed(f"version {version + 1}: no edge device connected within node_wait "
                                  f"{self.server.node_wait:g} s (a buffered run trains on edge devices: "
                                  f"`edge-client join`)")
            pause = POLL_SECONDS[0] if arrived else min(pause * 2, POLL_SECONDS[1])
            if version < total:
                self.sleep(pause)
        return state
