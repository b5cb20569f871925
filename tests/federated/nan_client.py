"""A ClientApp whose site 1 replies with NaN tensors: fedmvp's own ClientApp, its reply then spoiled.

Every reply it sends is also recorded (``$FEDMVP_TEST_REPLIES/r<round>-s<site>.safetensors``, the
number of examples as metadata), so a test can recompute what the server should have averaged."""

from __future__ import annotations

import os

import numpy as np
from safetensors.numpy import save_file
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedmvp.federated import client_app as real
from fedmvp.federated.wire import content_state, state_records

app = ClientApp()
app.query("identify")(real.identify)  # who it is, and its evaluation, as fedmvp's own ClientApp
app.evaluate()(real.evaluate)


@app.train()
def train(msg: Message, context: Context) -> Message:
    reply = real.train(msg, context)
    site = int(context.node_config["partition-id"])
    if site == 1 and len(reply.content["arrays"]):
        spoiled = state_records({k: np.full(v.shape, np.nan, np.float32) for k, v in content_state(reply.content).items()})
        reply = Message(content=RecordDict({**spoiled, "metrics": reply.content["metrics"],
                                            "identity": reply.content["identity"],
                                            "classes": reply.content["classes"]}), reply_to=msg)
    folder = os.environ.get("FEDMVP_TEST_REPLIES")
    if folder and len(reply.content["arrays"]):
        arrays = content_state(reply.content)
        examples = str(int(reply.content["metrics"]["num-examples"]))
        save_file(arrays, f"{folder}/r{int(msg.content['config']['round'])}-s{site}.safetensors",
                  metadata={"num_examples": examples})
    return reply
