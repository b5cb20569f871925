"""Evaluation by the nodes: every site on its own data (docs/method.md §7), in Flower's shape.

``NodeEvaluation`` is the strategies' evaluate half (``configure_evaluate``/``aggregate_evaluate``
with Flower's signatures); ``FedMVPStrategy`` (``strategy.py``) is the train half and the rounds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid

from fedmvp_formats.promptformer import promptformer_digest

from fedmvp.federated.eval_replies import combine_eval_replies
from fedmvp.federated.grid_poll import send_and_receive
from fedmvp.federated.metrics import evaluation_sites
from fedmvp.federated.wire import array_record, node_contents, numpy_state


class NodeEvaluation:
    """The evaluate half of ``FedMVPStrategy`` (its registry, instruction and round numbering)."""

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> list[Message]:
        """One evaluate message to every connected node the registry knows (each site evaluates its Local
        set and the evaluation sets assigned to it; an edge device its held-out images). ``arrays``
        empty: the zero-shot CLIP."""
        round_number = self.global_round(server_round)
        state = numpy_state(arrays)
        nodes = sorted(grid.get_node_ids())
        self._learn(grid, nodes, round_number)
        instruction = self._instruction(round_number, prompted=bool(state), assignment=self._assignment(),
                                        promptformer_digest=promptformer_digest(state) if state else "")
        content = node_contents(instruction, config, self.registry.open_site_of)
        return [Message(content=content(node, arrays), message_type=MessageType.EVALUATE, dst_node_id=node)
                for node in nodes if self.registry.site_of(node) is not None]

    def _assignment(self) -> dict[str, int]:
        if self.federation is None:
            raise RuntimeError("this strategy was built without the run's federation record: it cannot evaluate")
        return evaluation_sites(self.federation)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The paper's metrics from the sites' counts, combined as one process would (``eval_replies``);
        the whole result, None for a metric no site could compute, is kept as ``evaluation``."""
        self.evaluation = combine_eval_replies(replies, run_id=self.run_id, round_number=self.global_round(
            server_round), record=self.federation, num_sites=self.num_clients, site_names=self.site_names)
        return MetricRecord({k: v for k, v in self.evaluation.items() if isinstance(v, (int, float))})

    def evaluate_round(self, grid: Grid, state: dict[str, np.ndarray] | None, round_number: int) -> dict[str, Any]:
        """Evaluate ``state`` (None: zero-shot) on the nodes as of global round ``round_number``."""
        server_round = round_number - self.round_offset
        if state is None:  # the zero-shot row, before any round: wait, as round 1 will, for the nodes it needs
            self._targets(grid, round_number + 1, 0)  # else it covers whoever connected first (one site, say)
        messages = self.configure_evaluate(server_round, array_record(state) if state is not None else ArrayRecord(),
                                           ConfigRecord(), grid)
        self.aggregate_evaluate(server_round, send_and_receive(grid, messages, self.policy.server.round_timeout))
        return dict(self.evaluation)
