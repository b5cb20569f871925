"""Nodes claiming a listed site bound to a key (`[[sites]] node_key`) without proving they hold it.

One row per attack on the identify reply: what the node sends (its site-proof, signed by the site's
own ClientApp code or forged), and the fragment of the one reason the server gives. Each attack is
refused before anything from the node is used (``NodeRegistry.read`` raises; ``learn`` then sends
the node no work and says so in one line, naming the site); the honest node and an unbound site pass.
"""

from __future__ import annotations

import base64
from pathlib import Path
from types import SimpleNamespace

import pytest
from flwr.app import Context, Message, RecordDict

from fedmvp_formats import messages as schema
from fedmvp_formats.messages import Identity, MessageError

from fedmvp.federated.client_app import proof
from fedmvp.federated.sampling import IDENTIFY, NodeRegistry
from fedmvp.federated.site_keys import AUTH_KEY, NONCE, PROOF, PROOF_REQUEST, SiteKeys
from fedmvp.federated.wire import records_content
from fedmvp.presets.schema import SiteSpec

RUN, ROUND, NODE, NONCE_NOW = "run-1", 4, 77, "ab" * 16
NAMES = ["north", "south", "west"]  # west lists no node_key: unbound


@pytest.fixture(autouse=True)
def _flower_run_identity():  # a Message is built outside a Flower process (as tests/federated/test_identify.py)
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    from fedmvp_apps.deploy.certs import write_certs

    folder = tmp_path_factory.mktemp("site-keys")
    write_certs(folder, nodes=3)
    return folder


def registry(keys: Path) -> NodeRegistry:
    """A three-site run: north bound to node-0.pub, south to node-1.pub (relative paths), west unbound."""
    sites = [SiteSpec(name=n, node_key=f"node-{i}.pub" if i < 2 else "", base_dir=keys) for i, n in enumerate(NAMES)]
    bound = SiteKeys.from_preset(SimpleNamespace(sites=sites))
    return NodeRegistry(3, RUN, dict(enumerate(NAMES)), site_keys=bound)


def signed(keys: Path, key: str, site: int = 0, *, round_number: int = ROUND, node: int = NODE, nonce: str = NONCE_NOW,
           run_id: str = RUN) -> dict:
    """The site-proof a site's ClientApp sends (its own code path), signed with ``key`` for this request."""
    msg = Message(content=records_content({PROOF_REQUEST: {NONCE: nonce}}), message_type=IDENTIFY,
                  dst_node_id=node)
    context = Context(run_id=1, node_id=node, node_config={AUTH_KEY: str(keys / key)}, state=RecordDict(),
                      run_config={})
    return proof(msg, context, Identity(round=round_number, run_id=run_id, site=site, name=NAMES[site]))


ROWS = [  # (row, site claimed, the proof it sends given the key folder, the reason's fragment; None: accepted)
    ("honest site", 0, lambda k: signed(k, "node-0"), None),
    ("unbound site, no proof", 2, lambda k: {}, None),
    ("missing proof", 0, lambda k: {}, "sent no proof"),
    ("forged signature", 0, lambda k: {PROOF: base64.b64encode(b"\x30" * 100).decode()}, "does not verify"),
    ("not base64", 0, lambda k: {PROOF: "not a signature!"}, "does not verify"),
    ("a number", 0, lambda k: {PROOF: 12}, "is no signature"),
    ("a megabyte", 0, lambda k: {PROOF: "A" * (1 << 20)}, "is no signature"),
    ("replayed from another round", 0, lambda k: signed(k, "node-0", round_number=ROUND - 1), "does not verify"),
    ("replayed from another request", 0, lambda k: signed(k, "node-0", nonce="cd" * 16), "does not verify"),
    ("another node's proof", 0, lambda k: signed(k, "node-0", node=NODE + 1), "does not verify"),
    ("another run's proof", 0, lambda k: signed(k, "node-0", run_id="run-0"), "does not verify"),
    ("the key listed for another site", 0, lambda k: signed(k, "node-1"), "holds the key of site 1 'south'"),
    ("an admitted key listed for no site", 1, lambda k: signed(k, "node-2", site=1), "does not verify"),
]


@pytest.mark.parametrize("row, site, sent, reason", ROWS, ids=[r[0] for r in ROWS])
def test_a_node_claiming_a_bound_site_proves_its_key(keys, row, site, sent, reason):
    fields = {**Identity(round=ROUND, run_id=RUN, site=site, name=NAMES[site]).record(), **sent(keys)}
    content = records_content({schema.IDENTITY: fields})
    if reason is None:
        assert registry(keys).read(content, ROUND, NODE, NONCE_NOW) == site
        return
    with pytest.raises(MessageError) as err:
        registry(keys).read(content, ROUND, NODE, NONCE_NOW)
    line = str(err.value)
    assert reason in line and f"site {site} '{NAMES[site]}' is bound to node_key" in line, line
    assert line.isprintable() and len(line) < 300, line


def test_a_site_key_that_is_no_public_key_is_one_line_naming_the_file(tmp_path):
    from fedmvp.federated.site_keys import SiteKeyError

    (tmp_path / "north.pub").write_text("ssh-rsa nonsense\n")
    sites = [SiteSpec(name="north", node_key="north.pub", base_dir=tmp_path),
             SiteSpec(name="south", node_key="missing.pub", base_dir=tmp_path)]
    with pytest.raises(SiteKeyError, match="north.pub.*not an OpenSSH public key"):
        SiteKeys.from_preset(SimpleNamespace(sites=sites))
    with pytest.raises(SiteKeyError, match="missing.pub.*cannot read"):
        SiteKeys.from_preset(SimpleNamespace(sites=sites[1:]))


@pytest.mark.timeout(30)
def test_a_site_key_that_is_a_fifo_or_huge_is_refused_without_waiting(tmp_path):
    """`fedmvp serve` reads every node_key before it starts: a FIFO named as one used to block it forever
    on the open, and a huge file was read whole; both are one line naming the file (a link to a key is
    followed: keys are the operator's own files)."""
    import os

    from fedmvp.federated.site_keys import SiteKeyError

    os.mkfifo(tmp_path / "fifo.pub")
    (tmp_path / "huge.pub").write_bytes(b"ecdsa-sha2-nistp384 " + b"A" * (1 << 20))
    for name, problem in (("fifo.pub", "cannot read.*not a regular file"), ("huge.pub", "not an OpenSSH public key")):
        with pytest.raises(SiteKeyError, match=f"{name}.*{problem}"):
            SiteKeys.from_preset(SimpleNamespace(sites=[SiteSpec(name="north", node_key=name, base_dir=tmp_path)]))
