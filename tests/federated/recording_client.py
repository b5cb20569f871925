"""fedmvp's own ClientApp, every message it handles recorded: which kind, round and node, and the torch
threads the node trained with (``$FEDMVP_TEST_RECORD/<kind>-r<round>-p<partition>.json``), so a test
sees whom the server asked for what."""

from __future__ import annotations

import json
import os

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedmvp.federated import client_app as real
from fedmvp.federated.wire import content_records

app = ClientApp()


def _record(kind: str, msg: Message, context: Context) -> None:
    partition = int(context.node_config["partition-id"])
    row = {"kind": kind, "round": int(content_records(msg.content)["config"]["round"]), "partition": partition,
           "node": int(msg.metadata.dst_node_id), "threads": torch.get_num_threads()}
    path = f"{os.environ['FEDMVP_TEST_RECORD']}/{kind}-r{row['round']}-p{partition}.json"
    assert not os.path.exists(path), f"{path}: asked twice"
    with open(path, "w") as handle:
        json.dump(row, handle)


@app.query("identify")
def identify(msg: Message, context: Context) -> Message:
    _record("identify", msg, context)
    return real.identify(msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    reply = real.train(msg, context)
    _record("train", msg, context)  # after: the threads it trained with
    return reply


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    reply = real.evaluate(msg, context)
    _record("evaluate", msg, context)
    return reply
