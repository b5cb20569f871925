"""The federation's ClientApp: one FAB, two kinds of node, dispatched on the node's role.

A federation runs one Flower app (``fedmvp_apps/deploy/flower_app.toml``), but its
nodes are of two kinds:

* a **site** (``fedmvp join``; node config ``partition-id=N``, ``role`` absent or ``'site'``)
  trains the PromptFormer or its LoRA on its share of the preset's datasets with the training
  core (``fedmvp.federated.client_app``: open_clip, peft);
* an **edge** device (``edge-client join``; node config ``role='edge' bundle=... data=...``)
  trains only the LoRA of its exported bundle with the edge client's own code
  (``edge_client.node``), on an install without open_clip, peft or the training core.

A site's refusal that it explains in one line (a message that does not check, a class set that is not
the run's) is answered as an error reply with that line, printed once, not a traceback; a site that
took the run's class set from the server (`fedmvp join --classes-from-server`) says so once per set.

Each side is imported lazily, inside the handler that needs it, so an edge node never imports
``fedmvp`` and a site never imports the edge client. This module is an app of the top layer
(docs/architecture.md "Layers"): it may import both libraries, and none imports it. It stays a
top-level package, outside ``fedmvp_apps``, because its Flower component path
(``node_app.client_app:app``) is what every deployed FAB names.
"""

from __future__ import annotations

import time
from typing import Callable

from flwr.app import Context, Error, Message
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from fedmvp_formats.class_set import read_class_set
from fedmvp_formats.envelope import read_envelope
from fedmvp_formats.messages import CLASS_SET, EDGE, IDENTIFY, SITE, MessageError
from node_app.round_lines import MARK, said

ROLES = (SITE, EDGE)
_TAKEN: set[str] = set()  # the class sets this process took from the server and said so (by digest)

app = ClientApp()


def role(context: Context) -> str:
    """The node's role from its node config (``role``; a node without one is a site)."""
    value = str(context.node_config.get("role", SITE)).strip().lower()
    if value not in ROLES:
        raise RuntimeError(f"node config role={value!r}: expected one of {', '.join(ROLES)} "
                           f"(fedmvp join starts a site, edge-client join an edge device)")
    return value


@app.train()
def train(msg: Message, context: Context) -> Message:
    if role(context) == EDGE:
        from edge_client.node import train as handler

        return said("train", msg, lambda: handler(msg, context), time.monotonic())
    from fedmvp.federated.client_app import train as site_train

    return _site_said("train", site_train, msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    if role(context) == EDGE:
        from edge_client.node import evaluate as handler

        return said("evaluate", msg, lambda: handler(msg, context), time.monotonic())
    from fedmvp.federated.client_app import evaluate as site_evaluate

    return _site_said("evaluate", site_evaluate, msg, context)


def _site_said(kind: str, handler: Callable[[Message, Context], Message], msg: Message, context: Context) -> Message:
    """A site's reply and its line; a refusal the site explains in one line (a message that does not check,
    a class set that is not the run's) answered with that line as the error, not a traceback in its log."""
    from fedmvp.federated.site_classes import ClassSetMismatch

    try:
        return said(kind, msg, lambda: _site(handler, msg, context), time.monotonic())
    except (MessageError, ClassSetMismatch) as err:  # said printed the line already
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=str(err).splitlines()[0]),
                       reply_to=msg)


def _site(handler: Callable[[Message, Context], Message], msg: Message, context: Context) -> Message:
    """A site's reply; where the site took the run's class set from the server (`fedmvp join
    --classes-from-server`), one line says so the first time this process used that set."""
    from fedmvp.federated.site_classes import FROM_SERVER, taken_line

    reply = handler(msg, context)
    record = read_envelope(msg.content, msg.content.config_records).get(CLASS_SET)
    if context.node_config.get(FROM_SERVER) is True and record is not None:
        run = read_class_set(dict(record))  # checked by the handler already: it used this set
        if run.digest not in _TAKEN:
            _TAKEN.add(run.digest)
            print(f"{MARK}{taken_line(run)}", flush=True)
    return reply


@app.query(IDENTIFY)
def identify(msg: Message, context: Context) -> Message:
    """Who this node is (its site, or an edge device), asked once before the server sends it work."""
    if role(context) == EDGE:
        from edge_client.node import identify as edge_identify

        return edge_identify(msg, context)
    from fedmvp.federated.client_app import identify as site_identify

    return site_identify(msg, context)
