"""FedMVP's Flower strategy: rounds over whoever is there, every reply checked, per-tensor FedAvg.

Each round the strategy picks who trains, sends the global tensors, waits up to the round timeout,
checks every reply (``fedmvp.federated.replies``) and averages each tensor, weighted by examples,
over the clients that sent it (a LoRA-only client sends only ``lora.*``; stock FedAvg would refuse
such mixed replies). Tensors nobody sent keep their global value. A round that got fewer than
``min_nodes`` usable replies is tried again, never skipped silently.

Who trains:
* ``sites`` (the simulation, one node per site): a deterministic sample of *sites* per round,
  sent to every node; unselected sites answer with zero examples. A resumed run replays exactly.
* ``nodes`` (deployment): a sample of the *connected* nodes (``fraction``, at least ``min_nodes``;
  it waits up to ``node_wait`` for them); work goes to those nodes only.
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
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.supercore import log

from fedmvp_formats import messages as schema
from fedmvp_formats.messages import Identity, Instruction, MessageError, read_identity
from fedmvp_formats.names import LORA_PREFIX, PROMPTFORMER_PREFIX
from fedmvp_formats.promptformer import promptformer_digest

from fedmvp.federated.grid_poll import send_and_receive
from fedmvp.federated.metrics import combine_counts, evaluation_sites
from fedmvp.federated.seeds import derived_seed
from fedmvp.federated.replies import ReplyRules, check_reply, name_problem, reply_fields, site_counts
from fedmvp.federated.wire import array_record, instruction_content, numpy_state
from fedmvp.presets.server import ServerSpec


# ---- server maths ----------------------------------------------------------------------------------
def cosine_lr(base_lr: float, round_number: int, total_rounds: int) -> float:
    """Cosine decay over the rounds (round 1 uses base_lr; docs/method.md §6)."""
    if total_rounds <= 1:
        return base_lr
    return 0.5 * base_lr * (1 + math.cos(math.pi * (round_number - 1) / total_rounds))


def weighted_average(replies: list[tuple[dict[str, np.ndarray], float]]) -> dict[str, np.ndarray]:
    """Per-tensor FedAvg weighted by examples over the clients that SENT that tensor.

    LoRA-only clients send only ``lora.*``; full clients send ``promptformer.*``; a tensor
    nobody sent is absent from the result (the caller keeps the previous global value).
    """
    sums: dict[str, np.ndarray] = {}
    weights: dict[str, float] = {}
    for arrays, weight in replies:
        for key, value in arrays.items():
            contribution = np.asarray(value, dtype=np.float64) * weight
            sums[key] = sums[key] + contribution if key in sums else contribution
            weights[key] = weights.get(key, 0.0) + weight
    return {k: (sums[k] / weights[k]).astype(np.float32) for k in sums}


@dataclass(frozen=True)
class RoundPolicy:
    """How rounds run: who is asked (``sampling``, ``fraction``) and the run's server rules (the run
    record's ``server``, one definition: fedmvp/presets/server.py; docs/architecture.md)."""

    sampling: str = "sites"  # "sites" (simulation) or "nodes" (deployment)
    fraction: float = 1.0
    server: ServerSpec = field(default_factory=ServerSpec)


def _loss_summary(metrics: list[dict]) -> dict[str, float]:
    """Example-weighted mean losses; a part (CE, consistency) over the replies that report it (edge
    devices report only the total)."""
    out = {}
    for key in ("train-loss", "train-ce", "train-consistency"):
        pairs = [(float(m[key]), float(m["num-examples"])) for m in metrics if key in m]
        total = sum(w for _, w in pairs)
        out[key] = sum(v * w for v, w in pairs) / total if total else float("nan")
    return out


def _reply_record(node: int, verdict, metrics: dict, identity: Identity) -> dict:
    """One accepted reply as the round's state.json lists it."""
    record = {"node": node, "role": verdict.role, "examples": int(metrics[schema.NUM_EXAMPLES]),
              "loss": float(metrics.get(schema.TRAIN_LOSS, float("nan")))}
    if verdict.role == schema.EDGE:
        record |= {"bundle_id": identity.bundle_id, "refreshed": identity.refreshed,
                   "refresh_bytes": identity.refresh_bytes}
    else:
        record["site"] = verdict.site
        if identity.name is not None:
            record["name"] = identity.name
    if verdict.clipped_from is not None:
        record["clipped_from"] = verdict.clipped_from
    return record


class RoundFailed(RuntimeError):
    """A round could not gather enough usable replies (or nodes); the message says why."""


class FedMVPStrategy:
    """Rounds of per-tensor FedAvg over heterogeneous, checked replies (full PromptFormer or LoRA only)."""

    def __init__(self, *, client_config: dict[str, Any], seed: int, total_rounds: int, base_lr: float,
                 num_clients: int, run_id: str = "", declared_examples: dict[int, int | None] | None = None,
                 site_names: dict[int, str] | None = None,
                 policy: RoundPolicy | None = None, round_offset: int = 0, lora_clients: Iterable[int] = (),
                 on_aggregated: Callable[[int, dict[str, np.ndarray], dict], None] | None = None):
        """``client_config``: what every round's message carries besides the round's own values
        (``preset``, ``device``; ``method`` and ``local``, records as dicts: ``fedmvp_formats.messages``);
        ``declared_examples[site]``: the most training images a site can report (run record; None: its
        folder's, bounded by [server] site_max_examples); ``site_names``: a [federation] run's site
        names by id, the one each site's reply must carry (``replies.check_reply``)."""
        self.client_config = dict(client_config)
        self.seed = seed
        self.total_rounds = total_rounds
        self.base_lr = base_lr
        self.num_clients = num_clients
        self.run_id = run_id
        self.declared_examples = dict(declared_examples) if declared_examples is not None else \
            {site: 1 << 62 for site in range(num_clients)}
        self.site_names = dict(site_names) if site_names is not None else None
        self.policy = policy or RoundPolicy()
        self.round_offset = round_offset
        self.lora_clients: set[int] = set(lora_clients)
        self.global_state: dict[str, np.ndarray] = {}
        self.on_aggregated = on_aggregated
        self.rejected: list[dict] = []  # this round's left-out replies (node, site, reason)
        self.known: dict[int, dict] = {}  # node id -> what its last accepted reply said (role, digest, ...)

    @property
    def fraction(self) -> float:
        return self.policy.fraction

    def global_round(self, server_round: int) -> int:
        return self.round_offset + server_round

    def selected_clients(self, round_number: int) -> list[int]:
        """A fraction of sites per round, the same set whenever this round is replayed (``sites``)."""
        count = max(1, round(self.fraction * self.num_clients))
        if count >= self.num_clients:
            return list(range(self.num_clients))
        rng = random.Random(derived_seed(self.seed, "sample", round_number))
        return sorted(rng.sample(range(self.num_clients), count))

    def needed_replies(self, round_number: int) -> int:
        """Usable replies that close a round: ``min_nodes``, by default every client sampled."""
        if self.policy.sampling == "sites":
            selected = len(self.selected_clients(round_number))
            return min(self.policy.server.min_nodes or selected, selected)
        return self.policy.server.min_nodes or max(1, round(self.fraction * self.num_clients))

    # ---- who trains ---------------------------------------------------------------------------------
    def _connected(self, grid: Grid, needed: int) -> list[int]:
        deadline = time.monotonic() + self.policy.server.node_wait
        while True:
            nodes = sorted(grid.get_node_ids())
            if len(nodes) >= needed:
                return nodes
            if time.monotonic() >= deadline:
                raise RoundFailed(f"only {len(nodes)} of the {needed} nodes a round needs connected within "
                                  f"{self.policy.server.node_wait:g} s; start more SuperNodes (fedmvp join) or lower "
                                  f"min_nodes")
            time.sleep(1.0)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid, attempt: int = 0) -> list[Message]:
        round_number = self.global_round(server_round)
        self.global_state = numpy_state(arrays)
        digest = promptformer_digest(self.global_state)
        if self.policy.sampling == "sites":
            nodes = self._connected(grid, self.num_clients)
            selected = tuple(self.selected_clients(round_number))
        else:
            needed = self.needed_replies(round_number)
            connected = self._connected(grid, needed)
            count = min(len(connected), max(needed, round(self.fraction * len(connected))))
            rng = random.Random(derived_seed(self.seed, "nodes", round_number, attempt))
            nodes = sorted(rng.sample(connected, count))
            selected = None  # every node asked trains
        cc = self.client_config
        instruction = Instruction(round=round_number, run_id=self.run_id, promptformer_digest=digest,
                                  preset=cc.get("preset"), device=cc.get("device"), method=cc.get("method"),
                                  lr=cosine_lr(self.base_lr, round_number, self.total_rounds),
                                  lora_clients=tuple(sorted(self.lora_clients)), selected=selected,
                                  local=cc.get("local"))
        lora = array_record({k: v for k, v in self.global_state.items() if k.startswith(LORA_PREFIX)})
        record = instruction_content(arrays, instruction, config)
        lora_only = instruction_content(lora, instruction, config)
        return [Message(content=lora_only if self.holds(node, digest) else record, message_type=MessageType.TRAIN,
                        dst_node_id=node) for node in nodes]

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
        rules = ReplyRules(run_id=self.run_id, round=round_number, server=self.policy.server)
        expected = self._expected_names()
        contents, self.rejected = [], []
        for msg in replies:
            node = int(msg.metadata.src_node_id)
            if msg.has_error():
                self._reject(round_number, node, None, f"the client failed: {msg.error.reason}")
                continue
            fields = reply_fields(msg.content)  # the records checked; arrays converted only once checked
            if isinstance(fields, str):
                self._reject(round_number, node, None, fields)
                continue
            arrays, metrics = fields  # metrics and identity merged: a key told in both had one value
            if self.policy.sampling == "sites" and metrics.get(schema.NUM_EXAMPLES) == 0 and not arrays:
                continue  # a site not selected this round
            verdict = check_reply(arrays, metrics, rules=rules, global_state=self.global_state,
                                  expected_names=expected, declared_examples=self.declared_examples,
                                  site_names=self.site_names)
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
        averaged = weighted_average([(v.arrays, float(m[schema.NUM_EXAMPLES])) for _, v, m, _ in contents])
        bad = next((k for k, v in averaged.items() if not np.all(np.isfinite(v))), None)
        if bad is not None:  # never publish (or train on) a NaN global state
            raise RoundFailed(f"round {round_number}: the averaged tensor {bad} holds NaN or infinite values; "
                              f"the run stops")
        self.global_state = {**self.global_state, **averaged}
        for _, verdict, metrics, _ in contents:
            if verdict.role == schema.SITE and int(metrics.get(schema.SWITCH_NEXT, 0)):
                self.lora_clients.add(verdict.site)
        summary = _loss_summary([m for _, _, m, _ in contents])
        if not math.isfinite(summary["train-loss"]):
            raise RoundFailed(f"round {round_number}: the training loss is {summary['train-loss']}; the run stops "
                              f"(check the preset's lr and the last checkpoint)")
        summary |= {"clients": len(contents), "lora-clients": len(self.lora_clients),
                    "lora-uploads": sum(int(m.get(schema.LORA_ACTIVE, 1)) for _, _, m, _ in contents),
                    "edges": sum(v.role == "edge" for _, v, _, _ in contents),
                    "sites": [v.site for _, v, _, _ in contents if v.role == "site"],
                    "replies": [_reply_record(node, v, m, i) for node, v, m, i in contents],
                    "rejected": list(self.rejected)}
        if self.on_aggregated:
            self.on_aggregated(round_number, self.global_state, summary)
        return array_record(self.global_state), MetricRecord({k: v for k, v in summary.items()
                                                              if isinstance(v, (int, float))})

    def _reject(self, round_number: int, node: int | None, site: int | None, reason: str,
                role: str | None = None) -> None:
        who = "edge device" if role == "edge" else f"site {site}"
        log(WARNING, "round %s: reply of node %s (%s) left out: %s", round_number, node, who, reason)
        self.rejected.append({"node": node, "site": site, "reason": reason, **({"role": role} if role else {})})

    # ---- federated evaluation ---------------------------------------------------------------------------
    def federated_evaluate(self, grid: Grid, state: dict[str, np.ndarray] | None, round_number: int,
                           record: dict) -> dict:
        """Every connected node evaluates on its own data (its Local set and the evaluation sets
        assigned to its site); the server combines the counts exactly as a central evaluation
        would (docs/method.md §7). ``state`` None: zero-shot CLIP. Replies are checked like train
        replies (site, run, round, counts that make sense); a missing site leaves its sets out.
        Edge devices evaluate the global model on their held-out images: ``edge_acc`` pools their
        counts (``edge_devices`` of them), beside the paper's metrics, never inside them."""
        assignment = evaluation_sites(record)
        cc = self.client_config
        instruction = Instruction(round=round_number, run_id=self.run_id, prompted=state is not None,
                                  promptformer_digest=promptformer_digest(state) if state is not None else "",
                                  preset=cc.get("preset"), device=cc.get("device"), method=cc.get("method"),
                                  assignment=assignment)
        content = instruction_content(array_record(state) if state is not None else ArrayRecord(), instruction)
        nodes = self._connected(grid, 1)
        messages = [Message(content=content, message_type=MessageType.EVALUATE, dst_node_id=node) for node in nodes]
        counts: dict[int, dict[str, tuple[int, int]]] = {}
        edge_counts: dict[int, tuple[int, int]] = {}
        for msg in send_and_receive(grid, messages, self.policy.server.round_timeout):
            node = int(msg.metadata.src_node_id)
            if msg.has_error():
                log(WARNING, "evaluation of round %s: node %s failed: %s", round_number, node, msg.error.reason)
                continue
            metrics = dict(msg.content[schema.METRICS]) if schema.METRICS in msg.content else {}
            try:
                identity = read_identity(dict(msg.content[schema.IDENTITY]) if schema.IDENTITY in msg.content
                                         else {}, self.run_id, round_number)
                if identity.site is not None and (identity.site not in range(self.num_clients)
                                                  or identity.site in counts):
                    raise MessageError(f"site {identity.site} unknown or told twice")
                wrong_name = name_problem(identity, self.site_names)
                if wrong_name is not None:
                    raise MessageError(wrong_name)
            except MessageError as err:
                log(WARNING, "evaluation of round %s: reply of node %s left out (%s)", round_number, node, err)
                continue
            if identity.role == schema.EDGE:
                pair = schema.count_pair(metrics, schema.EDGE_SET)
                if pair is not None:
                    edge_counts[node] = pair
                continue
            counts[identity.site] = site_counts(metrics, assignment, identity.site)
        result = {**combine_counts(record, counts), "eval_sites": len(counts)}
        if edge_counts:
            correct, total = (sum(c[i] for c in edge_counts.values()) for i in (0, 1))
            result |= {"edge_acc": correct / total if total else None, "edge_devices": len(edge_counts)}
        return result

    # ---- the rounds ---------------------------------------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int) -> ArrayRecord:
        """Run ``num_rounds`` rounds; a round short of usable replies is tried again (``round_retries``)."""
        arrays = initial_arrays
        for server_round in range(1, num_rounds + 1):
            round_number = self.global_round(server_round)
            for attempt in range(self.policy.server.round_retries):
                messages = self.configure_train(server_round, arrays, ConfigRecord(), grid, attempt)
                replies = send_and_receive(grid, messages, self.policy.server.round_timeout)
                aggregated, _ = self.aggregate_train(server_round, replies)
                if aggregated is not None:
                    arrays = aggregated
                    break
                log(WARNING, "round %s: %s replies of %s nodes, %s rejected, %s usable ones needed (try %s of %s)",
                    round_number, len(replies), len(messages), len(self.rejected), self.needed_replies(round_number),
                    attempt + 1, self.policy.server.round_retries)
            else:
                raise RoundFailed(f"round {round_number}: fewer than {self.needed_replies(round_number)} usable "
                                  f"replies in {self.policy.server.round_retries} tries (see the log for each reply)")
        return arrays
