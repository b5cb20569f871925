"""The FedMVP ClientApp: a round of local training, and evaluation on this site's own data.

The client id comes from the node's config (``partition-id``, set by the simulation engine or by
``flower-supernode --node-config "partition-id=3"``); the preset (a shipped preset's name, else the
TOML path on the server's machine), the run's method record (what model to build) and the round's
settings come in the server's message. A SuperNode whose preset file lives elsewhere names it
itself: ``--node-config "partition-id=3 preset='/data/site3.toml'"``. A client not selected this
round answers with zero examples."""

from __future__ import annotations

import json
import os

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedmvp.federated.evaluation import site_counts
from fedmvp.federated.task import LocalSettings, local_train, task_context
from fedmvp.federated.wire import record_to_torch, torch_record
from fedmvp.model import FedMVPConfig

app = ClientApp()


def _threads() -> None:
    threads = int(os.environ.get("FEDMVP_CLIENT_THREADS", "0"))
    if threads > 0 and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def _site(context: Context) -> int:
    if "partition-id" not in context.node_config:
        raise RuntimeError("this SuperNode has no partition-id: start it with `fedmvp join --site N` "
                           "(or flower-supernode --node-config \"partition-id=N\"; N: its site, 0-based)")
    return int(context.node_config["partition-id"])


def _device(config) -> str:
    device = str(config.get("device", "cpu"))
    return "cpu" if device == "cuda" and not torch.cuda.is_available() else device


@app.train()
def train(msg: Message, context: Context) -> Message:
    _threads()
    config = msg.content["config"]
    client_id = _site(context)
    # Which site, run and round this reply belongs to: the server checks it before using the reply.
    identity = ConfigRecord({"partition-id": client_id, "round": int(config["round"]), "run-id": str(config["run-id"])})
    selected = json.loads(str(config["selected"]))  # None: every node asked trains (deployment)
    if selected is not None and client_id not in selected:
        metrics = MetricRecord({"num-examples": 0, "partition-id": client_id, "train-loss": 0.0, "train-ce": 0.0,
                                "train-consistency": 0.0, "lora-active": 0, "switch-next": 0})
        return Message(content=RecordDict({"arrays": ArrayRecord(), "metrics": metrics, "identity": identity}),
                       reply_to=msg)
    preset = str(context.node_config.get("preset", config["preset"]))
    method = FedMVPConfig.from_dict(json.loads(str(config["method"])), "the server's method record")
    ctx = task_context(preset, method, _device(config))
    client = ctx.client(client_id)
    lora_active = client_id in json.loads(str(config["lora-clients"]))
    result = local_train(ctx, client, record_to_torch(msg.content["arrays"]), int(config["round"]),
                         float(config["lr"]), lora_active, LocalSettings.from_json(str(config["local"])))
    metrics = MetricRecord({
        "num-examples": result.num_examples, "partition-id": client_id, "train-loss": result.loss,
        "train-ce": result.ce, "train-consistency": result.consistency,
        "lora-active": int(result.lora_active), "switch-next": int(result.switch_next),
    })
    return Message(content=RecordDict({"arrays": torch_record(result.state), "metrics": metrics,
                                       "identity": identity}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Federated evaluation (docs/method.md §7): this site's Local test set and the evaluation sets
    assigned to it, on its own data; only the counts go back."""
    _threads()
    config = msg.content["config"]
    client_id = _site(context)
    identity = ConfigRecord({"partition-id": client_id, "round": int(config["round"]), "run-id": str(config["run-id"])})
    preset = str(context.node_config.get("preset", config["preset"]))
    method = FedMVPConfig.from_dict(json.loads(str(config["method"])), "the server's method record")
    ctx = task_context(preset, method, _device(config))
    state = record_to_torch(msg.content["arrays"]) if int(config["prompted"]) else None
    counts = site_counts(ctx, client_id, state, json.loads(str(config["assignment"])))
    metrics = MetricRecord({f"{name}:{part}": int(value) for name, pair in counts.items()
                            for part, value in zip(("correct", "total"), pair)})
    return Message(content=RecordDict({"metrics": metrics, "identity": identity}), reply_to=msg)
