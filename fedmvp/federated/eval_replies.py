"""The nodes' evaluation replies, checked and combined into the paper's metrics (docs/method.md §7).

Each site evaluates, on its own data, its Local test set and the evaluation sets assigned to it
(``metrics.evaluation_sites``); only counts come back. The server combines them with the same
code a single process uses (``metrics.combine_counts``), so the numbers are the central ones. A
reply is checked like a train reply (site, run, round, counts that make sense); a missing site
leaves its sets out. Edge devices evaluate the global model on their held-out images:
``edge_acc`` pools their counts (``edge_devices`` of them), beside the paper's metrics, never
inside them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.app import Message

from fedmvp_formats import messages as schema
from fedmvp_formats.messages import MessageError, read_identity

from fedmvp.federated.flower_log import log_left_out
from fedmvp.federated.metrics import counted, evaluation_sites
from fedmvp.federated.replies import name_problem, one_line, site_counts
from fedmvp.federated.wire import content_records


def combine_eval_replies(replies: Iterable[Message], *, run_id: str, round_number: int, record: dict,
                         num_sites: int, site_names: dict[int, str] | None) -> dict[str, Any]:
    """The metrics of one evaluation (``combine_counts``) with the per-site counts they are of (``counted``:
    a table pairs zero-shot and tuned over the same sites), ``eval_sites`` (the sites counted) and, when
    edge devices answered, ``edge_acc`` and ``edge_devices``."""
    assignment = evaluation_sites(record)
    counts: dict[int, dict[str, tuple[int, int]]] = {}
    edge_counts: dict[int, tuple[int, int]] = {}
    for msg in replies:
        node = int(msg.metadata.src_node_id)
        if msg.has_error():
            log_left_out(f"evaluation of round {round_number}: left out the reply of node {node}: it failed: "
                         f"{one_line(msg.error.reason)}")
            continue
        try:
            records = content_records(msg.content)
            metrics = schema.read_metrics(records.get(schema.METRICS, {}))
            identity = read_identity(records.get(schema.IDENTITY, {}), run_id, round_number)
            if identity.site is not None and (identity.site not in range(num_sites) or identity.site in counts):
                raise MessageError(f"site {identity.site} unknown or told twice")
            wrong_name = name_problem(identity, site_names)
            if wrong_name is not None:
                raise MessageError(wrong_name)
        except MessageError as err:
            log_left_out(f"evaluation of round {round_number}: left out the reply of node {node}: {err}")
            continue
        if identity.role == schema.EDGE:
            pair = schema.count_pair(metrics, schema.EDGE_SET)
            if pair is not None:
                edge_counts[node] = pair
            continue
        counts[identity.site] = site_counts(metrics, assignment, identity.site)
    result = {**counted(record, counts), "eval_sites": len(counts)}
    if edge_counts:
        correct, total = (sum(c[i] for c in edge_counts.values()) for i in (0, 1))
        result |= {"edge_acc": correct / total if total else None, "edge_devices": len(edge_counts)}
    return result
