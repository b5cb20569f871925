"""Who trains a round, one way for the simulation and for a deployment (docs/architecture.md "Across machines").

The server samples *sites*, never nodes: a seeded fraction of the run's site ids per round
(``sample_sites``), the same set whenever that round is replayed (a resumed run replays exactly).
Only the nodes that serve those sites get the round's message. Which node serves which site the
server learns once per node (``NodeRegistry``): it asks every node it has not met yet to identify
itself (a Flower ``query`` message, action ``identify``; fedmvp_formats.messages), and the node
answers with the identity its own node config gives it (simulation: Flower's ``partition-id``;
deployment: ``fedmvp join --site/--name``; in an open federation, no [[sites]], the server numbers each
new name, ``site_registry``). Edge devices (``edge-client join``) answer ``role
edge``: they serve no site and are sampled among themselves with the same fraction.

Under ``[privacy]`` the edge devices are drawn otherwise (``poisson_edges``): each connected device is
included independently with probability ``fraction``, from OS entropy (``random.SystemRandom``), so no
participant can predict a draw and the accountant's Poisson-subsampled Gaussian holds
(docs/howto/privacy.md). A population too small for that (``poisson_fits``) is drawn as before and
charged q = 1.
"""

from __future__ import annotations

import math
import random
import secrets
from collections.abc import Iterable, Sequence
from logging import WARNING

from flwr.app import Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from fedmvp_formats import messages as schema
from fedmvp_formats.messages import Instruction, MessageError, read_identity

from fedmvp.federated.flower_log import log_left_out
from fedmvp.federated.grid_poll import send_and_receive
from fedmvp.federated.replies import name_problem
from fedmvp.federated.seeds import derived_seed
from fedmvp.federated.site_keys import NONCE, PROOF, PROOF_REQUEST, SiteKeys, new_nonce, payload
from fedmvp.federated.site_registry import SiteRegistry
from fedmvp.federated.site_registry import name_problem as site_name_problem
from fedmvp.federated.wire import content_records, instruction_content

IDENTIFY = f"{MessageType.QUERY}.{schema.IDENTIFY}"  # the message type a node answers with its identity


def sample_sites(seed: int, fraction: float, num_sites: int, round_number: int) -> list[int]:
    """A fraction of the sites (at least one), drawn with the round's own seed: replayable."""
    return sample_among(seed, fraction, range(num_sites), round_number)


def sample_among(seed: int, fraction: float, sites: Sequence[int], round_number: int) -> list[int]:
    """A fraction of ``sites`` (at least one when any), drawn with the round's own seed. An open
    federation draws from its numbered sites connected now; with every site there this is
    ``sample_sites``'s draw (``random.sample`` picks by position, a range and its list alike)."""
    sites = list(sites)
    count = max(1, round(fraction * len(sites)))
    if count >= len(sites):
        return sites
    rng = random.Random(derived_seed(seed, "sample", round_number))
    return sorted(rng.sample(sites, count))


def edge_count(fraction: float, population: int) -> int:
    """The edge devices a round wants: ``fraction`` of the connected ones (at least one when any is)."""
    return min(population, max(1, round(fraction * population)))


def over_selected(wanted: int, factor: float, available: int) -> int:
    """Devices sent work for ``wanted`` of them ([server] over_selection, ``dropouts``): ``ceil(factor x
    wanted)``, at most ``available`` (the product rounded to 9 digits first: 1.3 x 10 is 13, not 14)."""
    return min(available, math.ceil(round(factor * wanted, 9)))


def sample_edges(seed: int, fraction: float, edges: Iterable[int], round_number: int, attempt: int,
                 factor: float = 1.0) -> list[int]:
    """The round's edge devices: the same fraction of the connected ones (at least one when any is),
    over-selected by ``factor`` ([server] over_selection; 1: exactly that many)."""
    edges = sorted(edges)
    count = over_selected(edge_count(fraction, len(edges)), factor, len(edges))
    if count >= len(edges):
        return edges
    rng = random.Random(derived_seed(seed, "edges", round_number, attempt))
    return sorted(rng.sample(edges, count))


# Poisson sampling is used (and its rate charged) only where a round expects at least this many devices:
# below it, most draws would come up short and be drawn again, which no longer is Poisson sampling
# (one device at fraction 0.1 would train every round). docs/howto/privacy.md.
POISSON_MIN_EXPECTED = 5.0


def poisson_fits(fraction: float, population: int) -> bool:
    """Whether ``population`` devices at rate ``fraction`` are drawn by Poisson sampling (and charged
    ``fraction``): a rate below 1 and at least ``POISSON_MIN_EXPECTED`` devices expected per draw."""
    return fraction < 1.0 and fraction * population >= POISSON_MIN_EXPECTED


def poisson_edges(fraction: float, edges: Iterable[int], rng: random.Random | None = None) -> list[int]:
    """Each of ``edges`` independently with probability ``fraction``, drawn from OS entropy (``rng``:
    default ``secrets.SystemRandom``, never the run's public seed): possibly none."""
    rng = rng if rng is not None else secrets.SystemRandom()
    return sorted(e for e in sorted(edges) if rng.random() < fraction)


class KeyProofError(MessageError):
    """A node claiming a site bound to a key that did not prove it holds that key (``site_keys``)."""


class NodeRegistry:
    """node id -> the site it serves (an int) or ``edge``, learnt from each node's identity. In an open
    federation (``open_sites``) a site is its name: a new name is numbered (``site_registry``), a known
    one keeps its id, so two live nodes of one name serve one site (both are then left out). A listed site
    bound to a key (``site_keys``) is served only by a node that proves it holds that key (``site_keys``)."""

    def __init__(self, num_sites: int, run_id: str, site_names: dict[int, str] | None = None,
                 open_sites: SiteRegistry | None = None, site_keys: SiteKeys | None = None):
        self.num_sites, self.run_id, self.site_names = num_sites, run_id, site_names
        self.open_sites, self.site_keys = open_sites, site_keys
        self.roles: dict[int, int | str] = {}
        self.refused: dict[int, str] = {}  # node id -> why its identity was refused (it is sent no work)

    def site_of(self, node: int) -> int | str | None:
        """The site ``node`` serves, ``edge``, or None (not met yet, or its identity was refused)."""
        return self.roles.get(node)

    def unknown(self, nodes: Iterable[int]) -> list[int]:
        return sorted(n for n in nodes if n not in self.roles and n not in self.refused)

    def learn(self, grid: Grid, nodes: Iterable[int], instruction: Instruction, timeout: float) -> None:
        """Ask the nodes not met yet who they are (one query each, no tensors), waiting up to ``timeout``
        for the answers. A node that fails or does not answer is asked again next time; one whose identity
        is refused (a site out of range, a name that is not its site's, another run's reply) is never sent
        work. The buffered server asks without waiting (``identify_messages`` then ``hear``)."""
        messages, nonce = self.identify_messages(self.unknown(nodes), instruction)
        if messages:
            self.hear(send_and_receive(grid, messages, timeout), instruction.round, nonce)

    def identify_messages(self, nodes: Iterable[int], instruction: Instruction) -> tuple[list[Message], str]:
        """One identify query to each of ``nodes``, and the nonce their key proofs must sign."""
        nonce = new_nonce()  # a proof of an earlier request does not verify (site_keys.payload)
        content = instruction_content({}, instruction, extra={PROOF_REQUEST: {NONCE: nonce}})
        return [Message(content=content, message_type=IDENTIFY, dst_node_id=node) for node in nodes], nonce

    def hear(self, replies: Iterable[Message], round_number: int, nonce: str) -> None:
        """The identities in ``replies`` to identify queries of round ``round_number`` (signed over ``nonce``)."""
        for reply in replies:
            node = int(reply.metadata.src_node_id)
            if reply.has_error():
                log(WARNING, "node %s did not identify itself: %s", node, reply.error.reason)
                continue
            try:
                self.roles[node] = self.read(reply.content, round_number, node, nonce)
            except KeyProofError as err:  # said by fedmvp serve as it happens (flower_log)
                self.refused[node] = str(err)
                log_left_out(f"round {round_number}: node {node} is sent no work: {err}")
            except MessageError as err:
                self.refused[node] = str(err)
                log(WARNING, "node %s is sent no work: its identity %s", node, err)

    def read(self, content: RecordDict, round_number: int, node: int = 0, nonce: str = "") -> int | str:
        """The site (or ``edge``) an identify reply names, checked like a train reply's identity; a site
        bound to a key only with the node's proof of that key for this request (``node``, ``nonce``)."""
        fields = dict(content_records(content).get(schema.IDENTITY, {}))
        identity = read_identity(fields, self.run_id, round_number)
        if identity.role == schema.EDGE:
            return schema.EDGE
        if self.open_sites is not None:  # an open federation: the name is the site, numbered on first sight
            problem = site_name_problem(identity.name)
            if problem is not None:
                raise MessageError(f"names no usable site name ({problem})")
            return self.open_sites.register(identity.name)
        if identity.site not in range(self.num_sites):
            raise MessageError(f"names site {identity.site}, not one of the run's {self.num_sites}")
        problem = name_problem(identity, self.site_names)
        if problem is not None:
            raise MessageError(problem)
        if self.site_keys is not None:  # checked before anything from the node is used (docs/security.md)
            problem = self.site_keys.problem(identity.site, identity.name, fields.get(PROOF),
                                             payload(self.run_id, round_number, node, str(identity.name), nonce))
            if problem is not None:
                raise KeyProofError(problem)
        return identity.site

    def nodes_of(self, sites: Iterable[int], connected: Iterable[int]) -> list[int]:
        """The connected nodes that serve ``sites`` (two claiming one site both get it; the replies of
        both are then left out: ``FedMVPStrategy.aggregate_train``)."""
        wanted = set(sites)
        return sorted(n for n in connected if self.roles.get(n, schema.EDGE) != schema.EDGE and self.roles[n] in wanted)

    def sites(self, connected: Iterable[int]) -> list[int]:
        """The sites the ``connected`` nodes serve, each once."""
        return sorted({site for node in connected if isinstance(site := self.roles.get(node), int)})

    def open_site_of(self, node: int) -> int | None:
        """The id an open federation's message to ``node`` carries (None: sites are listed, or an edge device)."""
        site = self.roles.get(node) if self.open_sites is not None else None
        return site if isinstance(site, int) else None

    def edges(self, connected: Iterable[int]) -> list[int]:
        return sorted(n for n in connected if self.roles.get(n) == schema.EDGE)
