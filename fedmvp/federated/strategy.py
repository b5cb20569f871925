"""FedMVP's Flower strategy: rounds over whoever is there, every reply checked, per-tensor FedAvg.

Each round the strategy picks who trains, sends the global tensors, waits up to the round timeout,
checks every reply (``replies.py``) and applies them per tensor over the clients that sent it by the
run's update rule (``round_writer.RoundWriter``; by default ``aggregate.apply_updates``: FedAvg of fresh
replies, as all of these are; ``server_lr``, [privacy]). Tensors nobody sent keep their value. A round
short of ``min_nodes`` usable replies is tried again; a written round is evaluated when due, then saved.

Who trains (``fedmvp.federated.sampling``, one way for the simulation and a deployment): a seeded
sample of *sites* per round (``fraction``; a resumed run replays exactly), sent only to the nodes
that serve them (each node tells its site when first met) and to a sample of the connected edge
devices; it waits up to ``node_wait`` for ``min_nodes`` of them (default: every site sampled). An open
federation (no [[sites]]) samples among its numbered sites connected now (``site_registry``).
The server owns the per-site LoRA flags (keyed by the site id each node reports, sent down each
round, persisted in checkpoints) and the cosine schedule.

Edge devices (``edge-client join``) are nodes too: they train only the LoRA, reply like a site in
LoRA-only mode (checked by the same rules, weighted by examples) and are recorded per node
(role, bundle id, examples, loss) in the round's state.json. Every round message carries the
digest of the global PromptFormer; a device that last reported holding exactly that PromptFormer
gets the LoRA tensors only, any other node the whole global state (a stale device refreshes
its bundle from it; ``edge_client.node``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log

from fedmvp_formats import messages as schema
from fedmvp_formats.messages import Instruction
from fedmvp_formats.names import LORA_PREFIX, PROMPTFORMER_PREFIX
from fedmvp_formats.privacy import PrivacyRecord
from fedmvp_formats.promptformer import promptformer_digest

from fedmvp.federated.aggregate import Update
from fedmvp.federated.dropouts import RoundClose, wanted_devices
from fedmvp.federated.flower_log import log_left_out
from fedmvp.federated.grid_poll import send_and_receive
from fedmvp.federated.metrics import loss_summary
from fedmvp.federated.private_rounds import Draw, draw_edges, round_rate
from fedmvp.federated.replies import (ReplyRules, check_reply, left_out_line, left_out_record, reply_fields,
                                     reply_record, round_failed, too_few_nodes)
from fedmvp.federated.round_writer import RoundFailed, RoundRecord, RoundWriter, finite_loss
from fedmvp.federated.sampling import NodeRegistry, sample_among, sample_sites
from fedmvp.federated.strategy_eval import NodeEvaluation
from fedmvp.federated.strategy_options import RoundPolicy, StrategyOptions
from fedmvp.federated.wire import array_record, node_contents, numpy_state

__all__ = ["FedMVPStrategy", "RoundFailed", "RoundPolicy", "StrategyOptions", "cosine_lr"]


# ---- server maths ----------------------------------------------------------------------------------
def cosine_lr(base_lr: float, round_number: int, total_rounds: int) -> float:
    """Cosine decay over the rounds (round 1 uses base_lr; docs/method.md §6)."""
    if total_rounds <= 1:
        return base_lr
    return 0.5 * base_lr * (1 + math.cos(math.pi * (round_number - 1) / total_rounds))


class FedMVPStrategy(NodeEvaluation, Strategy):
    """Rounds of per-tensor FedAvg over heterogeneous, checked replies (full PromptFormer or LoRA only),
    in the shape of Flower's message-based ``Strategy``: ``configure_train``/``aggregate_train`` and
    ``configure_evaluate``/``aggregate_evaluate`` with Flower's signatures, ``start`` running the rounds,
    each written by the run's ``RoundWriter`` (``round_writer.py``)."""

    def __init__(self, options: StrategyOptions, writer: RoundWriter | None = None):
        """``writer``: the run's round lifecycle (None: rounds computed, nothing saved)."""
        self.options = options
        self.client_config = dict(options.client_config)
        self.seed, self.total_rounds, self.base_lr = options.seed, options.total_rounds, options.base_lr
        self.num_clients, self.run_id = options.num_clients, options.run_id
        self.declared_examples = dict(options.declared_examples) if options.declared_examples is not None else \
            {site: 1 << 62 for site in range(options.num_clients)}
        self.site_names = dict(options.site_names) if options.site_names is not None else None
        self.federation, self.class_rules = options.federation, options.class_rules
        self.policy, self.round_offset = options.policy, options.round_offset
        self.lora_clients: set[int] = set(options.lora_clients)
        self.global_state: dict[str, np.ndarray] = {}
        self.rejected: list[dict] = []  # this round's left-out replies (node, site, reason)
        self.sent_to: dict[str, int] = {}  # this try's message id -> the node it went to (once pushed)
        self.known: dict[int, dict] = {}  # node id -> what its last accepted reply said (role, digest, ...)
        self.open_sites = options.open_sites
        self.live_sites: list[int] = []  # an open federation: its numbered sites connected at the last count
        self.registry = NodeRegistry(self.num_clients, self.run_id, self.site_names,  # node -> its site, or edge
                                     self.open_sites.registry if self.open_sites is not None else None,
                                     options.site_keys)
        self._sync_sites(force=True)
        self.asked_edges, self.sent_edges, self.wanted_edges = 0, [], 0  # edge devices sent work, wanted of them
        self.evaluation: dict[str, Any] = {}  # the last evaluation, None for a metric no site could compute
        self.writer = writer or RoundWriter(None, self.policy.server, options.privacy, options.privacy_events)
        self.charged: dict[str, Any] | None = None  # the round's privacy record once it is charged
        self.draw = Draw()  # how the round's edge devices were drawn ([privacy]: what q it is charged)
        self.written: RoundRecord | None = None  # the last round aggregated, until it is saved

    @property
    def privacy(self) -> PrivacyRecord | None:
        """The run's [privacy] (None: none): the writer's, which charges and noises every round."""
        return self.writer.privacy

    @privacy.setter
    def privacy(self, value: PrivacyRecord | None) -> None:
        self.writer.privacy = value

    @property
    def privacy_events(self) -> list:
        """The privacy events of the rounds recorded so far (the writer's: it appends each release)."""
        return self.writer.events

    @property
    def fraction(self) -> float:
        return self.policy.fraction

    def global_round(self, server_round: int) -> int:
        return self.round_offset + server_round

    def selected_clients(self, round_number: int) -> list[int]:
        """The round's sites: a seeded fraction, the same set whenever this round is replayed; in an open
        federation a seeded fraction of its numbered sites connected now (``live_sites``)."""
        if self.open_sites is not None:
            return sample_among(self.seed, self.fraction, self.live_sites, round_number)
        return sample_sites(self.seed, self.fraction, self.num_clients, round_number)

    def _sync_sites(self, force: bool = False) -> None:
        """An open federation's sites as numbered so far (``OpenSites.view``)."""
        if self.open_sites is not None and (force or len(self.open_sites.registry.names) != self.num_clients):
            self.federation, self.site_names, self.declared_examples, self.class_rules = self.open_sites.view()
            self.num_clients = len(self.site_names)

    def _learn(self, grid: Grid, nodes: list[int], round_number: int) -> None:
        """Ask the nodes not met yet who they are; an open federation's new names join its sites."""
        self.registry.learn(grid, nodes, self._instruction(round_number), self.policy.server.round_timeout)
        self._sync_sites()

    def needed_replies(self, round_number: int) -> int:
        """Usable replies that close a round: ``min_nodes``, by default every site sampled (at most the
        nodes asked: the sampled sites and the edge devices sent work)."""
        selected = len(self.selected_clients(round_number))
        return min(self.policy.server.min_nodes or selected, selected + self.asked_edges)

    def summary(self) -> None:
        """Log the strategy's settings (Flower's ``Strategy.summary``)."""
        server = self.policy.server
        log(INFO, "\t├── sites: %s, fraction %.2f (seed %s), min_nodes %s", self.num_clients, self.fraction,
            self.seed, server.min_nodes or "every site sampled")
        log(INFO, "\t└── round_timeout %gs, node_wait %gs, round_retries %s", server.round_timeout,
            server.node_wait, server.round_retries)

    def _instruction(self, round_number: int, **values: Any) -> Instruction:
        cc = self.client_config
        return Instruction(round=round_number, run_id=self.run_id, preset=cc.get("preset"), device=cc.get("device"),
                           method=cc.get("method"), threads=cc.get("threads"), class_set=cc.get("class_set"),
                           **values)

    # ---- who trains: the round's sites, then the nodes that serve them (fedmvp.federated.sampling) -------
    def _targets(self, grid: Grid, round_number: int, attempt: int) -> tuple[list[int], list[int]]:
        """The nodes of the round's sites and its edge devices, once enough of them are connected (up to
        ``node_wait``); nodes not met yet are asked who they are first."""
        server = self.policy.server
        deadline, tries = time.monotonic() + server.node_wait, 0
        while True:
            connected = sorted(grid.get_node_ids())
            self._learn(grid, connected, round_number)
            if self.open_sites is not None:  # who may be sampled: the numbered sites connected now
                self.live_sites = self.registry.sites(connected)
            selected = self.selected_clients(round_number)
            sites = self.registry.nodes_of(selected, connected)
            edges, self.draw = draw_edges(self.privacy, self.fraction, self.registry.edges(connected), self.seed,
                                          round_number, attempt, tries, server.over_selection)  # [privacy]: Poisson
            tries += 1
            self.asked_edges, self.sent_edges = len(edges), edges
            self.wanted_edges = wanted_devices(self.draw, self.fraction, len(edges))  # over_selection: dropouts
            needed = self.needed_replies(round_number)  # the one rule: min_nodes, at most the nodes asked
            present = len({self.registry.site_of(node) for node in sites}) + len(edges)
            if self.open_sites is not None:  # it samples whoever is there: first min_nodes (one) of them
                present, needed = len(self.live_sites) + len(self.registry.edges(connected)), \
                    max(needed, server.min_nodes or 1)
            if present >= needed:
                return sites, edges
            if time.monotonic() >= deadline:
                raise RoundFailed(too_few_nodes(present, needed, server, self.registry.refused,
                                                self.registry.unknown(connected)))
            time.sleep(1.0)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid, attempt: int = 0) -> list[Message]:
        """The round's train messages: the whole global state to each node of a sampled site, the LoRA
        only to an edge device that holds the global PromptFormer. ``attempt``: the round's try (a retry
        samples edge devices anew; the sites of a round are always the same)."""
        round_number = self.global_round(server_round)
        self.global_state = numpy_state(arrays)
        digest = promptformer_digest(self.global_state)
        sites, edges = self._targets(grid, round_number, attempt)
        self.charge_privacy(round_number)  # its q known from the draw; past max_epsilon refused before any work
        instruction = self._instruction(round_number, promptformer_digest=digest,
                                        lr=cosine_lr(self.base_lr, round_number, self.total_rounds),
                                        lora_clients=tuple(sorted(self.lora_clients)),
                                        local=self.client_config.get("local"),
                                        privacy=self.privacy.record() if self.privacy else None)
        lora = array_record({k: v for k, v in self.global_state.items() if k.startswith(LORA_PREFIX)})
        content = node_contents(instruction, config, self.registry.open_site_of)
        return [Message(content=content(node, lora if self.holds(node, digest) else arrays),
                        message_type=MessageType.TRAIN, dst_node_id=node) for node in sorted(sites + edges)]

    def charge_privacy(self, round_number: int) -> None:
        """``self.charged``: the round's record at the rate its draw earns; past max_epsilon: `RoundFailed`."""
        if self.privacy is not None:
            lora_sites = set(self.selected_clients(round_number)) & self.lora_clients
            self.charged = self.writer.charge(round_rate(self.privacy, self.fraction, self.draw, lora_sites),
                                              round_number)

    @property
    def classes_digest(self) -> str | None:
        """The run's class-set digest a reply may name (None: a run without classes.json)."""
        return (self.client_config.get("class_set") or {}).get("digest")

    def holds(self, node: int, digest: str) -> bool:
        """Whether ``node`` is an edge device that last reported holding the PromptFormer ``digest``."""
        known = self.known.get(node, {})
        return known.get(schema.ROLE) == schema.EDGE and known.get(schema.PROMPTFORMER_DIGEST) == digest

    # ---- what comes back ------------------------------------------------------------------------------
    def _expected_names(self) -> dict[int, set[str]]:
        lora = {k for k in self.global_state if k.startswith(LORA_PREFIX)}
        full = {k for k in self.global_state if k.startswith(PROMPTFORMER_PREFIX)}
        return {site: (lora if site in self.lora_clients else full) for site in range(self.num_clients)}

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check and average one round's replies; (None, None) when fewer than needed were usable."""
        round_number = self.global_round(server_round)
        rules = ReplyRules(run_id=self.run_id, round=round_number, server=self.policy.server,
                           classes_digest=self.classes_digest)
        expected = self._expected_names()
        contents, self.rejected = [], []
        for msg in replies:
            node = self.sender(msg)
            if msg.has_error():
                self._reject(round_number, node, None, f"the client failed: {msg.error.reason}")
                continue
            fields = reply_fields(msg.content)  # the records checked; arrays converted only once checked
            if isinstance(fields, str):
                self._reject(round_number, node, None, fields)
                continue
            arrays, metrics = fields  # metrics and identity merged: a key told in both had one value
            verdict = check_reply(arrays, metrics, rules=rules, global_state=self.global_state,
                                  expected_names=expected, declared_examples=self.declared_examples,
                                  site_names=self.site_names, class_rules=self.class_rules)
            claimed, registered = verdict.site if verdict.role == schema.SITE else schema.EDGE, \
                self.registry.site_of(node)  # what it said it serves when first met (None: never asked)
            if verdict.accepted and registered is not None and registered != claimed:
                verdict.arrays, verdict.reason = None, f"identified itself as {registered}, replies as {claimed}"
            if not verdict.accepted:
                self.known.pop(node, None)  # next round it gets the whole global state again
                self._reject(round_number, node, verdict.site, verdict.reason or "rejected", verdict.role)
                continue
            if verdict.clipped_from is not None:
                log(WARNING, "round %s: node %s (%s %s): update norm %.4g clipped to %g", round_number, node,
                    verdict.role, verdict.site, verdict.clipped_from, self.policy.server.max_update_norm)
            identity = verdict.identity
            self.known[node] = {schema.ROLE: verdict.role, **(
                {schema.BUNDLE_ID: identity.bundle_id, schema.PROMPTFORMER_DIGEST: identity.promptformer_digest}
                if verdict.role == schema.EDGE else {"site": verdict.site})}
            contents.append((node, verdict, metrics, identity))
        sites = [v.site for _, v, _, _ in contents if v.role == "site"]
        duplicates = sorted({s for s in sites if sites.count(s) > 1})
        if duplicates:  # two nodes claiming one site: keep neither (their data would count twice)
            for site in duplicates:
                self._reject(round_number, None, site, "more than one node replied for this site")
            contents = [c for c in contents if c[1].role == "edge" or c[1].site not in duplicates]
        if len(contents) < self.needed_replies(round_number) or not contents:
            return None, None
        # Arrival order must not change the float sums: sites by id, then edge devices by bundle and node.
        contents.sort(key=lambda c: (0, c[1].site, "", 0) if c[1].role == "site"
                      else (1, 0, str(c[3].bundle_id or ""), c[0]))
        if self.privacy is not None and self.charged is None:
            self.charge_privacy(round_number)
        # every reply of a synchronous round is fresh: t = 0, its base the global state
        step = self.writer.apply(f"round {round_number}", self.global_state,
                                 [Update(v.arrays, int(m[schema.NUM_EXAMPLES])) for _, v, m, _ in contents],
                                 [(node, v.role) for node, v, _, _ in contents])
        self.global_state = {**self.global_state, **step.tensors}
        for _, verdict, metrics, _ in contents:
            if verdict.role == schema.SITE and int(metrics.get(schema.SWITCH_NEXT, 0)):
                self.lora_clients.add(verdict.site)
        summary = loss_summary([m for _, _, m, _ in contents])
        finite_loss(f"round {round_number}", summary["train-loss"])
        summary |= {"clients": len(contents), "lora-clients": len(self.lora_clients),
                    "lora-uploads": sum(int(m.get(schema.LORA_ACTIVE, 1)) for _, _, m, _ in contents),
                    "edges": sum(v.role == "edge" for _, v, _, _ in contents)}
        released = self.writer.released(self.charged, step, round_number, self.draw,  # charged where noise was added
                                        [(node, v.role, v.site, list(v.arrays)) for node, v, _, _ in contents])
        self.charged = None
        self.written = self._record(round_number, summary, released, sites=[
            v.site for _, v, _, _ in contents if v.role == "site"], replies=[
            reply_record(node, v, m, i, w) for (node, v, m, i), w in zip(contents, step.weights)],
            screened=self.writer.screened(step))
        return array_record(self.global_state), MetricRecord({k: v for k, v in summary.items()
                                                              if isinstance(v, (int, float))})

    def _record(self, round_number: int, summary: dict[str, Any], released: dict[str, Any], **parts: Any
                ) -> RoundRecord:
        """The round's record (its metrics row from ``summary``, the losses and counts) before evaluation."""
        privacy = released.get("privacy")
        row = {"round": round_number, "train_loss": summary["train-loss"], "train_ce": summary["train-ce"],
               "train_consistency": summary["train-consistency"], "clients": summary["clients"],
               "lora_clients": summary["lora-clients"], "edges": summary.get("edges", 0),
               **({"epsilon": privacy["epsilon"]} if privacy is not None else {})}
        return RoundRecord(round_number, row, seed=self.seed, lr=self.base_lr, total_rounds=self.total_rounds,
                           method=self.client_config.get("method"), rejected=list(self.rejected), privacy=privacy,
                           not_private=released.get("not_private"), **parts)

    def close_round(self, grid: Grid, record: RoundRecord, state: dict[str, np.ndarray]) -> None:
        """A written round evaluated by the nodes when due, then saved (``RoundWriter.save``)."""
        record.lora_clients = sorted(self.lora_clients)
        if self.options.due(record.round):
            record.metrics |= self.evaluate_round(grid, state, record.round)
        self.writer.save(record, state)
        self.written = None

    def _reject(self, round_number: int, node: int | None, site: int | None, reason: str,
                role: str | None = None) -> None:
        entry = left_out_record(node, site, reason, role, self.site_names)  # state.json's and the printed line's
        log_left_out(left_out_line(round_number, entry))
        self.rejected.append(entry)

    # ---- the rounds ---------------------------------------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float | None = None,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Flower's ``Strategy.start``, with FedMVP's rules: a round short of usable replies is tried again
        (``round_retries``) and never skipped; ``timeout`` (default: [server] round_timeout) bounds each
        try. Each round is then evaluated by the nodes when due (``eval_every``, the last round) and saved
        (``close_round``); ``evaluate_fn`` is called as Flower calls it, before the first round and after
        each one. ``evaluate_config`` is not used (evaluation goes by ``evaluate_round``)."""
        timeout = self.policy.server.round_timeout if timeout is None else timeout
        result, arrays = Result(arrays=initial_arrays), initial_arrays
        if evaluate_fn is not None and (res := evaluate_fn(0, arrays)) is not None:
            result.evaluate_metrics_serverapp[0] = res
        for server_round in range(1, num_rounds + 1):
            round_number, began = self.global_round(server_round), time.monotonic()
            left_out: list[dict] = []  # every try's left-out replies: what the failure names
            for attempt in range(self.policy.server.round_retries):
                messages = self.configure_train(server_round, arrays, ConfigRecord(train_config or {}), grid, attempt)
                closing = RoundClose(messages, self.sent_edges, self.wanted_edges, self.needed_replies(round_number))
                replies = list(send_and_receive(grid, messages, timeout, closing.enough if len(
                    self.sent_edges) > self.wanted_edges else None))  # over-selected: closes once enough replied
                self.sent_to = {m.metadata.message_id: int(m.metadata.dst_node_id) for m in messages}
                aggregated, metrics = self.aggregate_train(server_round, closing.split(
                    replies, round_number, self.policy.server.over_selection))
                if aggregated is not None:
                    result.arrays = arrays = aggregated
                    result.train_metrics_clientapp[server_round] = metrics
                    break
                left_out += self.rejected
                log(WARNING, "round %s: %s replies of %s nodes, %s rejected, %s usable ones needed (try %s of %s)",
                    round_number, len(replies), len(messages), len(self.rejected), self.needed_replies(round_number),
                    attempt + 1, self.policy.server.round_retries)
            else:
                raise RoundFailed(round_failed(round_number, self.needed_replies(round_number),
                                               self.policy.server.round_retries, left_out))
            record = self.written
            record.timed_out, record.late, record.devices = closing.record(replies, self.unanswered(messages, replies))
            record.seconds = time.monotonic() - began
            self.close_round(grid, record, self.global_state)
            if self.options.due(round_number):
                result.evaluate_metrics_clientapp[server_round] = MetricRecord(
                    {k: v for k, v in self.evaluation.items() if isinstance(v, (int, float))})
            if evaluate_fn is not None and (res := evaluate_fn(server_round, arrays)) is not None:
                result.evaluate_metrics_serverapp[server_round] = res
        return result

    def sender(self, reply: Message) -> int:
        """The node a reply answers for: the node its message was sent to. The SuperLink answers itself
        (node 1, ``Node Unavailable``) for a node that stopped its heartbeat; that reply is the node's."""
        return self.sent_to.get(reply.metadata.reply_to_message_id, int(reply.metadata.src_node_id))

    def unanswered(self, messages: Iterable[Message], replies: Iterable[Message]) -> list[str]:
        """Who was sent the round's work and never replied: a site by its name (else ``site N``), an edge
        device as ``edge node N``."""
        answered = {self.sender(r) for r in replies}
        out = []
        for node in sorted(int(m.metadata.dst_node_id) for m in messages):
            if node in answered:
                continue
            site = self.registry.site_of(node)
            if site is None or site == schema.EDGE:
                out.append(f"edge node {node}")
            else:
                out.append((self.site_names or {}).get(site) or f"site {site}")
        return out
