"""A node tells the server who it is from its node config alone: the federation's ClientApp
(node_app.client_app) answers the ``query.identify`` message for a site and for an edge device, and
the server's registry (fedmvp.federated.sampling.NodeRegistry) reads the answer."""

from __future__ import annotations

import pytest
from flwr.app import ArrayRecord, Context, Message, RecordDict

from fedmvp_formats.messages import Instruction

from fedmvp.federated.sampling import IDENTIFY, NodeRegistry
from fedmvp.federated.wire import instruction_content


@pytest.fixture(autouse=True)
def _flower_run_identity():
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield


def ask(node_config: dict) -> Message:
    from node_app.client_app import app

    content = instruction_content(ArrayRecord(), Instruction(round=4, run_id="r", preset="demo"))
    msg = Message(content=content, message_type=IDENTIFY, dst_node_id=7)
    context = Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={})
    return app(msg, context)


@pytest.mark.parametrize("node_config, role", [({"partition-id": 3}, 3), ({"partition-id": 9}, None),
                                               ({"role": "edge", "bundle": "b", "data": "d"}, "edge")])
def test_a_node_identifies_itself_from_its_node_config(node_config, role):
    registry = NodeRegistry(num_sites=8, run_id="r")
    reply = ask(node_config)
    if role is None:  # a site the run does not have: refused, never sent work
        with pytest.raises(ValueError, match="names site 9"):
            registry.read(reply.content, 4)
        return
    assert registry.read(reply.content, 4) == role
    with pytest.raises(ValueError, match="round 4, not of round 5"):
        registry.read(reply.content, 5)
