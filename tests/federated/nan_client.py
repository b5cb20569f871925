"""A ClientApp whose site 1 replies with NaN tensors: fedmvp's own ClientApp, its reply then spoiled.

Every reply it sends is also recorded (``$FEDMVP_TEST_REPLIES/r<round>-s<site>.safetensors``, the
number of examples as metadata), so a test can recompute what the server should have averaged."""

from __future__ import annotations

import os

import numpy as np
from safetensors.numpy import save_file
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedmvp.federated import client_app as real
from fedmvp.federated.wire import content_records, content_state, records_content, state_records

app = ClientApp()
app.query("identify")(real.identify)  # who it is, and its evaluation, as fedmvp's own ClientApp
app.evaluate()(real.evaluate)


@app.train()
def train(msg: Message, context: Context) -> Message:
    reply = real.train(msg, context)
    site = int(context.node_config["partition-id"])
    records = content_records(reply.content)
    if site == 1 and "arrays" in records:
        spoiled = state_records({k: np.full(v.shape, np.nan, np.float32) for k, v in content_state(reply.content).items()})
        reply = Message(content=records_content({**records, **spoiled}), reply_to=msg)
    folder = os.environ.get("FEDMVP_TEST_REPLIES")
    if folder and "arrays" in records:
        arrays = content_state(reply.content)
        examples = str(int(records["metrics"]["num-examples"]))
        save_file(arrays, f"{folder}/r{int(content_records(msg.content)['config']['round'])}-s{site}.safetensors",
                  metadata={"num_examples": examples})
    return reply
