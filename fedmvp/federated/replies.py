"""Every client reply is checked before it is averaged.

A reply that arrives over the network is untrusted: a crashed client, a client of another run,
a stale reply of an earlier round, a NaN, a wrong shape or an oversized update must never reach
the global model. ``check_reply`` applies the rules in order and either returns the tensors to
average (possibly clipped) or the reason the reply was left out. The server logs every
rejection (node, site, reason) and records it in the round's state.json; the round goes on
with the other replies. A reason is one line: whatever the sender wrote in it is escaped and cut
short (``shown``).

Before those rules, ``reply_fields`` checks the records themselves: one ConfigRecord of folded
records (``fedmvp_formats.envelope``), numbers only in ``metrics``, no key told twice with two values,
every value the server later uses of the type it uses it as (a NaN loss or a string byte count would stop
the round, not just this reply). The tensors travel packed (.npy bytes and their ``layout`` record,
``fedmvp_formats.packed``); ``wire_arrays`` converts them only after the layout's names and shapes,
the bytes' type and count, and the .npy header inside them (float32 only, as every client sends, of
the layout's element count), all match the round: ``np.load`` allocates whatever shape a header
declares. The tensor checks are the leaf's one (``fedmvp_formats.tensors``); the update-norm bound
(``bound_update``) also judges the update files of `fedmvp ingest` (``ingest.py``).

A site's reply also says what it trained on, its ``classes`` record (class name -> training images):
the names must be classes the run's record gives that site (a [federation] site: a base class, never
a held-out new one), the counts must add up to its ``num-examples``, and the server records them per
reply (``ClassRules``, ``reply_classes``); an edge device may send one (checked against the whole class set).

Two kinds of sender: a **site** (identified by the ``partition-id`` it serves; it sends the
tensors of its mode, at most its training set's images) and an **edge** device (``role``
``edge``, ``edge-client join``; LoRA only, as a site in LoRA-only mode, at most
``[server] edge_max_examples`` images). The same rules hold for both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import RecordDict

from fedmvp_formats import messages as schema
from fedmvp_formats.messages import Identity, MessageError, count_pair, count_sets, is_int, read_identity
from fedmvp_formats.names import LORA_PREFIX
from fedmvp_formats.packed import LAYOUT, read_wire
from fedmvp_formats.shown import name_shown, shown
from fedmvp_formats.tensors import tensor_problem

from fedmvp.federated.wire import content_records
from fedmvp.presets.server import ServerSpec


@dataclass(frozen=True)
class WireTensors:
    """A reply's tensors as they came: its ``arrays`` record and its ``layout`` (None: none sent)."""

    arrays: dict[str, Any] | None
    layout: dict[str, Any] | None = None


@dataclass(frozen=True)
class ReplyRules:
    """What a reply (or an ingested update file) must satisfy in round ``round`` of run ``run_id``: the
    run's server rules (one definition, fedmvp/presets/server.py). ``server.max_update_norm``: the
    largest L2 distance of a reply's tensors to the round's global tensors (None: no bound); beyond
    it the reply is clipped back onto the bound or rejected (``server.update_norm_action``)."""

    run_id: str | None
    round: int
    server: ServerSpec = field(default_factory=ServerSpec)
    classes_digest: str | None = None  # the run's class-set digest: a reply naming another is refused


@dataclass
class Verdict:
    """The outcome for one reply: ``arrays`` to average, or ``reason`` it was left out."""

    site: int | None
    arrays: dict[str, np.ndarray] | None = None
    role: str = schema.SITE  # or schema.EDGE
    reason: str | None = None
    clipped_from: float | None = None  # the update norm before clipping, when it was clipped
    identity: Identity | None = None  # the reply's identity, once it was read
    classes: dict[str, int] | None = None  # its training images per class (an edge device: when it said)
    notes: list[str] = field(default_factory=list)

    @property
    def accepted(self) -> bool:
        return self.arrays is not None


def reply_fields(content: RecordDict) -> tuple[WireTensors, dict[str, Any]] | str:
    """A train reply's tensors as they came (``arrays`` and ``layout``) and its ``metrics``, ``identity`` (and ``classes``, as a dict
    under that key) merged, or why the records cannot be used. A key in both must have one value: the rules would otherwise check one
    and the average use the other."""
    try:
        records = content_records(content)
        metrics = schema.read_metrics(records[schema.METRICS])
    except KeyError as err:
        return f"malformed reply (no {name_shown(str(err.args[0]))} record)"
    except MessageError as err:
        return f"malformed reply ({err})"
    identity = records.get(schema.IDENTITY, {})
    fields = dict(metrics)
    if schema.CLASSES in records:  # its own record (a mapping), checked by reply_classes
        if schema.CLASSES in metrics or schema.CLASSES in identity:
            return f"metrics or identity also hold {schema.CLASSES}, a record of its own"
        fields[schema.CLASSES] = dict(records[schema.CLASSES])
    for key, value in identity.items():
        if key in fields and (type(fields[key]) is not type(value) or fields[key] != value):
            return f"metrics and identity disagree on {name_shown(key)}"
        fields[key] = value
    try:
        schema.check_train_metrics(fields)
    except MessageError as err:
        return str(err)
    return WireTensors(records.get(schema.ARRAYS), records.get(LAYOUT)), fields


def edge_counts(identity: dict, metrics: dict, run_id: str, round_number: int) -> tuple[int, int] | None:
    """(correct, total) of an edge device's evaluation reply, None if it is not one of this round's
    or its counts make no sense."""
    try:
        read_identity(identity, run_id, round_number)
    except MessageError:
        return None
    return count_pair(metrics, schema.EDGE_SET)


def site_counts(metrics: dict, assignment: dict[str, int], site: int) -> dict[str, tuple[int, int]]:
    """A site's evaluation counts by set: its ``local`` set and the sets ``assignment`` gives it, each
    kept only when its counts are integers that make sense (a NaN, a float or a negative count, or
    more correct than total, leaves that set out rather than stopping the server)."""
    kept = {name: count_pair(metrics, name) for name in count_sets(metrics)
            if name == "local" or assignment.get(name) == site}
    return {name: pair for name, pair in kept.items() if pair is not None}


@dataclass(frozen=True)
class ClassRules:
    """Which classes a train reply may say it trained on, from the run's federation record: a site
    those the record gives it (its partition's; a [federation] site's: the base classes, so a held-out
    new class is never claimed as trained on, docs/method.md §7), an edge device any class of the set."""

    sites: dict[int, frozenset[str]]
    federation: frozenset[str]

    @classmethod
    def from_record(cls, record: dict) -> "ClassRules":
        sites = {int(c["id"]): frozenset(c["classes"]) for c in record["clients"]}
        every = frozenset().union(*sites.values(), *(e["classes"] for e in record.get("evaluations", [])))
        return cls(sites, every)


def reply_classes(fields: dict[str, Any], examples: int, identity: Identity,
                  rules: ClassRules | None) -> dict[str, int] | None | str:
    """A train reply's training images per class (None: an edge device that did not say), or why it
    is left out: a site must say; the counts are images (``read_class_counts``) that add up to its
    ``num-examples`` (else the FedAvg weight and the record disagree); each name one ``rules`` allows
    (None: names unchecked)."""
    record = fields.get(schema.CLASSES)
    edge = identity.role == schema.EDGE
    if record is None:
        return None if edge else f"no {schema.CLASSES} record (a site says its training images per class)"
    try:
        counts = schema.read_class_counts(record)
    except MessageError as err:
        return str(err)
    if rules is not None:
        allowed = rules.federation if edge else rules.sites.get(identity.site, frozenset())
        stray = next((name for name in counts if name not in allowed), None)
        if stray is not None:
            whose = "the federation's class set" if edge else f"site {identity.site}'s classes in the run's record"
            return f"{schema.CLASSES}: {shown(stray)} is not in {whose}"
    total = sum(counts.values())
    if total != examples:
        return f"{schema.CLASSES} count {total} images, num-examples {examples}"
    return counts


def name_problem(identity: Identity, site_names: dict[int, str] | None) -> str | None:
    """Why a site's reply does not carry the name of the site it claims (None: it does, or the run's
    sites have no names): a [federation] site's id is its place among the preset's [[sites]] (open
    membership: the id its name was given, ``site_registry``), so a node named otherwise claiming that
    id is another site's impostor (docs/security.md)."""
    if identity.role == schema.EDGE or site_names is None or identity.name == site_names.get(identity.site):
        return None
    return f"site-name {shown(identity.name)} is not site {identity.site}'s ({shown(site_names.get(identity.site))})"


def check_reply(arrays: WireTensors | dict[str, np.ndarray], metrics: Any, *, rules: ReplyRules,
                global_state: dict[str, np.ndarray], expected_names: dict[int, set[str]],
                declared_examples: dict[int, int | None], site_names: dict[int, str] | None = None,
                class_rules: ClassRules | None = None) -> Verdict:
    """Check one train reply. ``expected_names[site]``: the tensors that site was asked to send
    (LoRA only after its switch, else the PromptFormer); ``declared_examples[site]``: the most
    training images that site can hold (from the run record; None: a [federation] site whose folder
    the server cannot see, bounded by ``rules.server.site_max_examples``). ``site_names[site]``: a
    [federation] run's site names, the one each site's reply must carry (its id is its place among
    the preset's [[sites]]). ``class_rules``: the classes each may claim (``reply_classes``). An edge
    device (``role`` ``edge``) must send exactly the round's LoRA tensors and at most
    ``rules.server.edge_max_examples`` images.
    ``arrays`` as they came (`WireTensors`: converted by `wire_arrays` once the rules above held)."""
    try:
        identity = read_identity(metrics, rules.run_id, rules.round, rules.classes_digest)
    except MessageError as err:
        site = metrics.get(schema.PARTITION_ID)
        role = schema.EDGE if metrics.get(schema.ROLE) == schema.EDGE else schema.SITE
        return Verdict(site if is_int(site) else None, role=role, reason=str(err))
    edge, site, role = identity.role == schema.EDGE, identity.site, identity.role
    if not edge and site not in expected_names:
        return Verdict(site, reason=f"unknown site {shown(site)}")
    problem = name_problem(identity, site_names)
    if problem is not None:
        return Verdict(site, role=role, reason=problem)
    examples = metrics.get(schema.NUM_EXAMPLES)
    if not is_int(examples) or examples <= 0:
        return Verdict(site, role=role,
                       reason=f"num-examples {shown(metrics.get(schema.NUM_EXAMPLES))} is not a positive integer")
    declared = declared_examples.get(site, 0)
    bound = rules.server.edge_max_examples if edge else \
        rules.server.site_max_examples if declared is None else declared
    if examples > bound:
        whose = f"an edge device's bound ([server] edge_max_examples {bound})" if edge \
            else f"a site's bound ([server] site_max_examples {bound})" if declared is None \
            else f"the site's {bound} training images"
        return Verdict(site, role=role, reason=f"num-examples {examples} exceeds {whose}")
    classes = reply_classes(metrics, examples, identity, class_rules)
    if isinstance(classes, str):
        return Verdict(site, role=role, reason=classes)
    wanted = {k for k in global_state if k.startswith(LORA_PREFIX)} if edge else expected_names[site]
    if isinstance(arrays, WireTensors):
        arrays = wire_arrays(arrays, global_state, wanted)
        if isinstance(arrays, str):
            return Verdict(site, role=role, reason=arrays)
    problem = tensor_problem(arrays, {k: global_state[k].shape for k in wanted})
    if problem is not None:
        return Verdict(site, role=role, reason=problem)
    as_float32 = {k: np.asarray(arrays[k], dtype=np.float32) for k in sorted(arrays)}
    kept, reason, clipped_from = bound_update(as_float32, global_state, rules.server)
    return Verdict(site, arrays=kept, reason=reason, clipped_from=clipped_from, role=role, identity=identity,
                   classes=classes)


def wire_arrays(wire: WireTensors, reference: dict[str, np.ndarray], wanted: set[str]
                ) -> dict[str, np.ndarray] | str:
    """A reply's tensors as float32 numpy, or why not, judged before a byte of them is converted:
    the layout's names exactly ``wanted`` and its shapes the round's, then the packed bytes: their type,
    .npy header (float32, the layout's count) and length (``fedmvp_formats.packed.read_wire``)."""
    try:
        return read_wire(wire.arrays, wire.layout, {name: reference[name].shape for name in wanted})
    except MessageError as err:
        return str(err)


def bound_update(arrays: dict[str, np.ndarray], reference: dict[str, np.ndarray], server: Any
                 ) -> tuple[dict[str, np.ndarray] | None, str | None, float | None]:
    """The L2 bound on an update's distance to ``reference``: ``(arrays, None, None)`` within it,
    ``(clipped, None, norm)`` clipped onto it, ``(None, reason, None)`` rejected (``update_norm_action``).
    The bound is ``server.max_update_norm``; unset, ``max_update_rms`` times the square root of the values
    the update sends, so no update is unbounded (docs/howto/robust.md, "Devices: a robust default")."""
    deltas = {k: arrays[k].astype(np.float64) - reference[k].astype(np.float64) for k in arrays}
    norm = math.sqrt(sum(float(np.sum(d * d)) for d in deltas.values()))
    if server.max_update_norm is not None:
        max_norm, named = float(server.max_update_norm), f"the bound {server.max_update_norm:g}"
    else:
        values = sum(d.size for d in deltas.values())
        max_norm = float(server.max_update_rms) * math.sqrt(values)
        named = f"the default bound {max_norm:.4g} (max_update_rms {server.max_update_rms:g} x sqrt({values} values))"
    if norm <= max_norm:
        return arrays, None, None
    if server.update_norm_action == "reject":
        return None, f"update norm {norm:.4g} exceeds {named}", None
    scale = max_norm / norm
    clipped = {k: (reference[k].astype(np.float64) + deltas[k] * scale).astype(np.float32) for k in arrays}
    return clipped, None, norm


def reply_record(node: int, verdict, metrics: dict, identity: Identity, weight: dict | None = None) -> dict:
    """One accepted reply as the round's state.json lists it (``verdict``: its ``check_reply``; ``weight``:
    its staleness, s(t) and weight, ``aggregate.apply_updates``)."""
    record = {"node": node, "role": verdict.role, "examples": int(metrics[schema.NUM_EXAMPLES]),
              "loss": float(metrics.get(schema.TRAIN_LOSS, float("nan"))), **(weight or {})}
    if verdict.role == schema.EDGE:
        record |= {"bundle_id": identity.bundle_id, "refreshed": identity.refreshed,
                   "refresh_bytes": identity.refresh_bytes}
    else:
        record["site"] = verdict.site
        if identity.name is not None:
            record["name"] = identity.name
    if verdict.classes is not None:
        record["classes"] = verdict.classes
    if verdict.clipped_from is not None:
        record["clipped_from"] = verdict.clipped_from
    return record


# ---- left-out replies, as the operator reads them (docs/troubleshooting.md) --------------------------------
def left_out_record(node: int | None, site: int | None, reason: str, role: str | None,
                    site_names: dict[int, str] | None) -> dict:
    """One left-out reply as the round's state.json lists it (``rejected``), and the printed line's source."""
    name = site_names.get(site) if site_names and site is not None and role != schema.EDGE else None
    return {"node": node, "site": site, **({"name": name} if name is not None else {}), "reason": one_line(reason),
            **({"role": role} if role else {})}


def one_line(reason: str) -> str:
    """A reason as one printable line: a node's own error text (a traceback, an escape sequence) is shown
    escaped, so it can neither forge a line of the operator's output nor reach a terminal raw."""
    return reason if reason.isprintable() else shown(reason, 300)


def sender(entry: dict) -> str:
    """Who sent a left-out reply: its site (id and name) or an edge device, and its node."""
    node = entry.get("node")
    if entry.get("role") == schema.EDGE:
        who = "an edge device"
    elif entry.get("site") is not None:
        who = f"site {entry['site']}" + (f" {shown(entry['name'])}" if "name" in entry else "")
    else:
        return f"node {node}" if node is not None else "an unidentified sender"
    return who + (f" (node {node})" if node is not None else "")


def left_out_line(round_number: int, entry: dict) -> str:
    """The line `fedmvp train` and `fedmvp serve` print for a left-out reply as it happens."""
    return f"round {round_number}: left out the reply of {sender(entry)}: {entry['reason']}"


def round_failed(round_number: int, needed: int, tries: int, entries: list[dict]) -> str:
    """Why a round could not close: one summary line, then each left-out sender and reason once."""
    head = f"round {round_number}: fewer than {needed} usable replies in {tries} tries"
    reasons = list(dict.fromkeys(f"{sender(e)}: {e['reason']}" for e in entries))
    if not reasons:
        return f"{head} (no reply was left out: too few came back within round_timeout)"
    return f"{head}; left out:" + "".join(f"\n  {reason}" for reason in reasons)


def too_few_nodes(present: int, needed: int, server: ServerSpec, refused: dict[int, str], silent: list[int]) -> str:
    """Why a round could not start: too few nodes within ``node_wait``; then each node whose identity was
    refused (it is sent no work) and how many connected nodes never said who they are."""
    lines = [f"only {present} of the {needed} nodes a round needs connected within {server.node_wait:g} s; start "
             f"more SuperNodes (fedmvp join) or lower min_nodes"]
    lines += [f"  node {node} is sent no work: its identity {one_line(reason)}"
              for node, reason in sorted(refused.items())]
    if silent:
        lines.append(f"  {len(silent)} connected node(s) did not say who they are within round_timeout "
                     f"{server.round_timeout:g} s (nodes {', '.join(map(str, silent[:5]))})")
    return "\n".join(lines)
