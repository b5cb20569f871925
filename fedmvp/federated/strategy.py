"""FedMVP's Flower strategy: per-tensor FedAvg that accepts replies with different tensor sets.

Stock FedAvg raises ``InconsistentMessageReplies`` when one client sends LoRA only and
another the whole PromptFormer. Here each tensor is averaged, weighted by examples,
over the clients that sent it; tensors nobody sent keep their global value. The server
owns the per-client LoRA flags (sent down each round, persisted in checkpoints), the
cosine schedule and a deterministic client sample, so a resumed run replays exactly.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Callable, Iterable
from logging import WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from fedmvp.federated.wire import array_record, numpy_state


# ---- server maths ----------------------------------------------------------------------------------
def derived_seed(*parts: object) -> int:
    """A stable 63-bit seed from (run seed, round, client, ...): resume replays the same randomness."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


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


class FedMVPStrategy(FedAvg):
    """FedAvg per tensor over heterogeneous replies (full PromptFormer or LoRA only)."""

    def __init__(self, *, client_config: dict[str, str], seed: int, total_rounds: int, base_lr: float,
                 num_clients: int, fraction: float, round_offset: int = 0,
                 lora_clients: Iterable[int] = (),
                 on_aggregated: Callable[[int, dict[str, np.ndarray], dict], None] | None = None):
        """``client_config``: what every round's message carries besides the round's own values
        (preset, device, the method record and the local settings, as strings)."""
        super().__init__(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=num_clients,
                         min_available_nodes=num_clients)
        self.client_config = dict(client_config)
        self.seed = seed
        self.total_rounds = total_rounds
        self.base_lr = base_lr
        self.num_clients = num_clients
        self.fraction = fraction
        self.round_offset = round_offset
        self.lora_clients: set[int] = set(lora_clients)
        self.global_state: dict[str, np.ndarray] = {}
        self.on_aggregated = on_aggregated

    def global_round(self, server_round: int) -> int:
        return self.round_offset + server_round

    def selected_clients(self, round_number: int) -> list[int]:
        """A fraction of clients per round, the same set whenever this round is replayed."""
        count = max(1, round(self.fraction * self.num_clients))
        if count >= self.num_clients:
            return list(range(self.num_clients))
        rng = random.Random(derived_seed(self.seed, "sample", round_number))
        return sorted(rng.sample(range(self.num_clients), count))

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        round_number = self.global_round(server_round)
        self.global_state = numpy_state(arrays)
        config["round"] = round_number
        config["lr"] = cosine_lr(self.base_lr, round_number, self.total_rounds)
        for key, value in self.client_config.items():
            config[key] = value
        config["lora-clients"] = json.dumps(sorted(self.lora_clients))
        config["selected"] = json.dumps(self.selected_clients(round_number))
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        round_number = self.global_round(server_round)
        contents = []
        for msg in replies:
            if msg.has_error():
                log(WARNING, "round %s: a client failed: %s", round_number, msg.error.reason)
                continue
            metrics = msg.content["metrics"]
            if int(metrics["num-examples"]) > 0:
                contents.append((int(metrics["partition-id"]), numpy_state(msg.content["arrays"]), metrics))
        if not contents:
            return None, None
        contents.sort(key=lambda item: item[0])  # arrival order must not change the float sums
        averaged = weighted_average([(arrays, float(m["num-examples"])) for _, arrays, m in contents])
        self.global_state = {**self.global_state, **averaged}
        for client_id, _, metrics in contents:
            if int(metrics["switch-next"]):
                self.lora_clients.add(client_id)
        total = sum(float(m["num-examples"]) for _, _, m in contents)
        summary = {key: sum(float(m[key]) * float(m["num-examples"]) for _, _, m in contents) / total
                   for key in ("train-loss", "train-ce", "train-consistency")}
        summary |= {"clients": len(contents), "lora-clients": len(self.lora_clients),
                    "lora-uploads": sum(int(m["lora-active"]) for _, _, m in contents)}
        if self.on_aggregated:
            self.on_aggregated(round_number, self.global_state, summary)
        return array_record(self.global_state), MetricRecord(summary)
