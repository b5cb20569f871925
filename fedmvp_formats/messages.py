"""The Flower message schema: what the server asks of a node, and what a node's reply says.

One definition for the server's strategy (``fedmvp.federated.strategy``), a site's ClientApp
(``fedmvp.federated.client_app``) and an edge device (``edge_client.node``); docs/architecture.md
"Records that travel". Flower is not imported here (the leaf stays numpy, safetensors and the
standard library): records are plain dicts of ConfigRecord values (int, float, str, bool, bytes,
or a list of one of those), all of a message's folded into its ONE ``ConfigRecord`` as
``<record>.<key>`` keys (``fedmvp_formats.envelope``: a message is 3 Flower objects), which each
package wraps at its edge. No value is a JSON string: a list travels as a list, and a mapping as
its own record:

===============  ======================================================================
``arrays``       the tensors: ``tensors``, the packed .npy bytes (the global state down, the
                 trained one up; ``fedmvp_formats.packed``)
``layout``       where each tensor is in them (``names``, ``ranks``, ``dims``)
``config``       the instruction's scalars and lists (``Instruction``)
``method``       the run's method record (``FedMVPConfig.to_dict()``), train and evaluate
``local``        a site's round settings (``LocalSettings``), train only
``assignment``   evaluation set name -> the site that evaluates it, evaluate only
``metrics``      a reply's numbers (``train_metrics``, ``count_metrics``; ``read_metrics``)
``identity``     who replies, for which run and round (``Identity``: one builder, one reader)
``classes``      a site's train reply: class name -> training images (``read_class_counts``)
``privacy``      the run's ``[privacy]`` settings (``fedmvp_formats.privacy``), train only, when set
``class-set``    the run's class set: digest, names, one phrases digest per class and the phrases
                 themselves (``fedmvp_formats.class_set``: one writer, one checked reader)
===============  ======================================================================

Every reader checks what arrives: a wrong type or a missing key raises `MessageError`, one line
whose untrusted parts are escaped and cut short (``fedmvp_formats.shown``). A reply is untrusted:
the server refuses it with that line as the reason (``fedmvp.federated.replies``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedmvp_formats.bounds import MAX_LOSS, MAX_SECONDS
from fedmvp_formats.shown import name_shown, shown

# ---- record names in a message's RecordDict ---------------------------------------------------------
ARRAYS, CONFIG, METHOD, LOCAL, ASSIGNMENT = "arrays", "config", "method", "local", "assignment"
METRICS, IDENTITY = "metrics", "identity"
CLASSES = "classes"  # a train reply's training images per class, recorded per site (docs/architecture.md)
PRIVACY = "privacy"  # the run's [privacy] settings: what a sender clips (and noises) its delta by
CLASS_SET = "class-set"  # the run's class set (fedmvp_formats.class_set), train and evaluate: checked before use

# ---- keys ---------------------------------------------------------------------------------------------
ROUND, RUN_ID, PROMPTFORMER_DIGEST = "round", "run-id", "promptformer-digest"  # instruction and identity
LR, PRESET, DEVICE, LORA_CLIENTS, THREADS, PROMPTED = "lr", "preset", "device", "lora-clients", "threads", "prompted"
PARTITION_ID, ROLE, BUNDLE_ID = "partition-id", "role", "bundle-id"
SITE_NAME = "site-name"  # a [federation] site's name (`fedmvp join --name`): its identity and node config key
CLASSES_DIGEST = "classes-digest"  # a reply's identity: the class-set digest the node trained or evaluated with
SITE_ID = "site-id"  # an open federation's (no [[sites]]) id for the node's name, numbered by the server
UNNUMBERED = -1  # the partition-id an open federation's site identifies with before the server numbered it
REFRESHED, REFRESH_BYTES = "refreshed", "refresh-bytes"
NUM_EXAMPLES, TRAIN_LOSS, TRAIN_CE, TRAIN_CONSISTENCY = "num-examples", "train-loss", "train-ce", "train-consistency"
LORA_ACTIVE, SWITCH_NEXT, REFRESH_SECONDS = "lora-active", "switch-next", "refresh-seconds"
SITE, EDGE = "site", "edge"  # the two roles (docs/architecture.md "Records that travel")
EDGE_SET = "edge"  # an edge device's evaluation counts: edge:correct, edge:total
IDENTIFY = "identify"  # the query action (message type ``query.identify``) a node answers with its identity

MAX_TEXT = 128  # a run id, a bundle id, a digest, a role
FLAGS = (LORA_ACTIVE, SWITCH_NEXT)  # 0 or 1
LOSSES = (TRAIN_LOSS, TRAIN_CE, TRAIN_CONSISTENCY, REFRESH_SECONDS)  # finite numbers; train-loss required


class MessageError(ValueError):
    """A message record that does not follow the schema; one line, what the sender wrote escaped."""


def site_name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a site's name (None: it can): 1 to MAX_TEXT characters, not blank. One rule
    for `fedmvp join --name`, the server meeting a name, and the run's site registry."""
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_TEXT:
        return f"a site name is 1 to {MAX_TEXT} characters, not blank"
    return None


# ---- typed reads of one value ------------------------------------------------------------------------
def is_int(value: Any) -> bool:
    """An int, not a bool (True is an int to Python) and not a float that happens to be whole."""
    return isinstance(value, int) and not isinstance(value, bool)


def _text(fields: Mapping[str, Any], key: str, required: bool = False) -> str | None:
    value = fields.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise MessageError(f"{key} {shown(value)} is not a string of at most {MAX_TEXT} characters")
    return value


def _int_list(fields: Mapping[str, Any], key: str) -> tuple[int, ...] | None:
    value = fields.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(is_int(v) for v in value):
        raise MessageError(f"{key} is not a list of integers ({shown(value)})")
    return tuple(value)


def _flag(fields: Mapping[str, Any], key: str) -> bool:
    value = fields.get(key, 0)
    if not is_int(value) or value not in (0, 1):
        raise MessageError(f"{key} {shown(value)} is not 0 or 1")
    return bool(value)


def _record(records: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """A record of ConfigRecord values as a plain dict (None: absent)."""
    record = records.get(name)
    if record is None:
        return None
    if not isinstance(record, Mapping):
        raise MessageError(f"the {name} record is not a mapping")
    for key, value in record.items():
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(v, (int, float, str, bool, bytes)) for v in items):
            raise MessageError(f"{name} {name_shown(str(key))}: {shown(value)} is not a record value")
    return {str(k): (list(v) if isinstance(v, list) else v) for k, v in record.items()}


# ---- the server's instruction (train and evaluate) -----------------------------------------------------
@dataclass(frozen=True)
class Instruction:
    """What a train, evaluate or identify message tells a node. Train: ``lr``, ``lora_clients``,
    ``local``, ``privacy`` (what the sender clips and, in local mode, noises its LoRA delta by; a None
    value left out, records hold none); evaluate: ``prompted``, ``assignment``. ``preset``, ``device``,
    ``method`` and ``threads`` (the CPU threads the server allots each node, the simulation's share of its
    machine; None: the node's own) are a site's (an edge device has its bundle). ``site``: in an open
    federation (a [federation] preset without [[sites]]) the id the server gave this node's name, sent to
    that node only (absent where sites are listed: a listed site's id is its place). Every node asked trains: the
    server sends work only to the nodes of the sites it sampled (fedmvp.federated.sampling)."""

    round: int
    run_id: str
    promptformer_digest: str = ""  # "": none (a zero-shot evaluation)
    preset: str | None = None
    device: str | None = None
    method: dict[str, Any] | None = None
    lr: float | None = None
    lora_clients: tuple[int, ...] | None = None
    threads: int | None = None
    local: dict[str, Any] | None = None
    prompted: bool = True
    assignment: dict[str, int] | None = None
    privacy: dict[str, Any] | None = None  # fedmvp_formats.privacy.PrivacyRecord.record(); None: no DP
    site: int | None = None
    class_set: dict[str, Any] | None = None  # fedmvp_formats.class_set.ClassSet.record(); None: a run without one

    def records(self) -> dict[str, dict[str, Any]]:
        """The message's config records by name (absent parts left out)."""
        config: dict[str, Any] = {ROUND: self.round, RUN_ID: self.run_id, PROMPTFORMER_DIGEST: self.promptformer_digest,
                                  PROMPTED: self.prompted}
        optional = {PRESET: self.preset, DEVICE: self.device, LR: self.lr,
                    LORA_CLIENTS: None if self.lora_clients is None else list(self.lora_clients),
                    THREADS: self.threads, SITE_ID: self.site}
        config |= {k: v for k, v in optional.items() if v is not None}
        out = {CONFIG: config}
        for name, record in ((METHOD, self.method), (LOCAL, self.local), (ASSIGNMENT, self.assignment),
                             (PRIVACY, self.privacy), (CLASS_SET, self.class_set)):
            if record is not None:
                out[name] = {k: v for k, v in record.items() if v is not None}
        return out

    def need(self, part: str) -> Any:
        """A part a reader needs (``method``, ``local``, ``lr``, ...), or `MessageError` naming it."""
        value = getattr(self, part.replace("-", "_"))
        if value is None:
            raise MessageError(f"the server's message has no {part}")
        return value


def read_instruction(records: Mapping[str, Any]) -> Instruction:
    """The instruction of a message's config records (``{name: record}``), every value checked."""
    config = _record(records, CONFIG)
    if config is None:
        raise MessageError(f"the server's message has no {CONFIG} record")
    round_number = config.get(ROUND)
    if not is_int(round_number):
        raise MessageError(f"{ROUND} {shown(round_number)} is not a round number")
    lr = config.get(LR)
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr)):
        raise MessageError(f"{LR} {shown(lr)} is not a finite number")
    prompted = config.get(PROMPTED, True)
    if not isinstance(prompted, bool):
        raise MessageError(f"{PROMPTED} {shown(prompted)} is not true or false")
    threads = config.get(THREADS)
    if threads is not None and (not is_int(threads) or threads < 1):
        raise MessageError(f"{THREADS} {shown(threads)} is not a positive integer")
    site = config.get(SITE_ID)
    if site is not None and (not is_int(site) or site < 0):
        raise MessageError(f"{SITE_ID} {shown(site)} is not a site id")
    assignment = _record(records, ASSIGNMENT)
    if assignment is not None and not all(is_int(site) for site in assignment.values()):
        raise MessageError(f"the {ASSIGNMENT} record does not map set names to sites")
    return Instruction(round=round_number, run_id=_text(config, RUN_ID, required=True),
                       promptformer_digest=_text(config, PROMPTFORMER_DIGEST) or "",
                       preset=_string(config, PRESET), device=_text(config, DEVICE),
                       method=_record(records, METHOD), lr=None if lr is None else float(lr),
                       lora_clients=_int_list(config, LORA_CLIENTS), threads=threads,
                       local=_record(records, LOCAL), prompted=prompted, assignment=assignment,
                       privacy=_record(records, PRIVACY), site=site, class_set=_record(records, CLASS_SET))


def _string(fields: Mapping[str, Any], key: str) -> str | None:
    """A string of any length (a preset path may be long)."""
    value = fields.get(key)
    if value is not None and not isinstance(value, str):
        raise MessageError(f"{key} {shown(value)} is not a string")
    return value


# ---- who replies: the one identity record ---------------------------------------------------------------
@dataclass(frozen=True)
class Identity:
    """A reply's identity: a site (``site``, its partition id; ``name`` too where sites are named) or an edge device (``site`` None; its
    bundle, the PromptFormer it holds, whether this round refreshed it and what that cost), for
    ``run_id`` and ``round``. The server checks it before using the reply and keeps it per node."""

    round: int
    run_id: str
    site: int | None = None
    name: str | None = None  # a named site's name ([federation] presets; its site is its place among them)
    bundle_id: str | None = None
    promptformer_digest: str | None = None
    refreshed: bool = False
    refresh_bytes: int = 0
    classes_digest: str | None = None  # the class set it used (fedmvp_formats.class_set); None: not said

    def _classes(self) -> dict[str, Any]:
        return {} if self.classes_digest is None else {CLASSES_DIGEST: self.classes_digest}

    @property
    def role(self) -> str:
        return SITE if self.site is not None else EDGE

    def record(self) -> dict[str, Any]:
        """The ``identity`` record: a site's partition id, or role edge and (when it has synced a bundle)
        the bundle's id and digest, the refresh flag (0/1) and bytes; then round and run id."""
        if self.site is not None:
            return {PARTITION_ID: self.site, ROUND: self.round, RUN_ID: self.run_id,
                    **({SITE_NAME: self.name} if self.name is not None else {}), **self._classes()}
        out: dict[str, Any] = {ROLE: EDGE, ROUND: self.round, RUN_ID: self.run_id, **self._classes()}
        if self.bundle_id is not None:
            out |= {BUNDLE_ID: self.bundle_id, PROMPTFORMER_DIGEST: str(self.promptformer_digest),
                    REFRESHED: int(self.refreshed), REFRESH_BYTES: int(self.refresh_bytes)}
        return out


def read_identity(fields: Mapping[str, Any], run_id: str | None = None, round_number: int | None = None,
                  classes_digest: str | None = None) -> Identity:
    """A reply's identity, every field checked (texts bounded, the flag 0 or 1, a byte count, a site an
    integer); with ``run_id`` and ``round_number``, also that the reply is of this run and round; with
    ``classes_digest``, that a reply naming a class set names the run's."""
    for key in (RUN_ID, ROLE, BUNDLE_ID, PROMPTFORMER_DIGEST, SITE_NAME, CLASSES_DIGEST):
        _text(fields, key)
    refreshed = _flag(fields, REFRESHED)
    refresh_bytes = fields.get(REFRESH_BYTES, 0)
    if not is_int(refresh_bytes) or refresh_bytes < 0:
        raise MessageError(f"{REFRESH_BYTES} {shown(refresh_bytes)} is not a byte count")
    role = fields.get(ROLE, SITE)
    if role not in (SITE, EDGE):
        raise MessageError(f"{ROLE} {shown(role)} is not {SITE} or {EDGE}")
    site = fields.get(PARTITION_ID) if role == SITE else None
    if role == SITE and not is_int(site):
        raise MessageError(f"unknown site {shown(site)}")
    if run_id is not None and fields.get(RUN_ID) != run_id:
        raise MessageError(f"reply of another run ({shown(fields.get(RUN_ID))})")
    said = fields.get(CLASSES_DIGEST)
    if classes_digest is not None and said is not None and said != classes_digest:
        raise MessageError(f"reply of another class set (classes-digest {shown(said, 20)}, the run's is "
                           f"{classes_digest[:16]}...): the node's attribute file is not the run's")
    got = fields.get(ROUND)
    if not is_int(got) or (round_number is not None and got != round_number):
        raise MessageError(f"reply of round {shown(got)}" + (f", not of round {round_number}"
                                                             if round_number is not None else ""))
    return Identity(round=got, run_id=str(fields.get(RUN_ID)), site=site,
                    name=fields.get(SITE_NAME) if role == SITE else None, bundle_id=fields.get(BUNDLE_ID),
                    promptformer_digest=fields.get(PROMPTFORMER_DIGEST), refreshed=refreshed,
                    refresh_bytes=refresh_bytes, classes_digest=said)


# ---- what a reply reports ----------------------------------------------------------------------------------
def train_metrics(num_examples: int, loss: float, **parts: float | int | bool | None) -> dict[str, Any]:
    """A train reply's metrics: ``num-examples``, ``train-loss`` and the parts given (``ce``,
    ``consistency``, ``lora_active``, ``switch_next``, ``refresh_seconds``; None left out)."""
    keys = {"ce": TRAIN_CE, "consistency": TRAIN_CONSISTENCY, "lora_active": LORA_ACTIVE,
            "switch_next": SWITCH_NEXT, "refresh_seconds": REFRESH_SECONDS}
    out: dict[str, Any] = {NUM_EXAMPLES: int(num_examples), TRAIN_LOSS: float(loss)}
    for name, value in parts.items():
        if value is not None:
            out[keys[name]] = int(value) if keys[name] in FLAGS else float(value)
    return out


def read_metrics(record: Any) -> dict[str, Any]:
    """A reply's ``metrics`` record: numbers only (an int or a finite-or-not float, never a bool, a
    string or bytes; or a list of them), as a Flower MetricRecord holds; a string count would stop
    the round, not just this reply. `MessageError` otherwise."""
    if not isinstance(record, Mapping):
        raise MessageError(f"the {METRICS} record is not a mapping")
    for key, value in record.items():
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items):
            raise MessageError(f"{METRICS} {name_shown(str(key))}: {shown(value)} is not a number")
    return dict(record)


def check_train_metrics(fields: Mapping[str, Any]) -> None:
    """The flags 0 or 1, the losses finite numbers within ``MAX_LOSS`` (``train-loss`` required): a NaN loss
    or a string flag would stop the round, not just this reply; 1e308 would make its mean infinite.
    ``num-examples`` is the caller's (its bound)."""
    for key in FLAGS:
        if key in fields:
            _flag(fields, key)
    for key in LOSSES:
        value = fields.get(key, 0.0 if key != TRAIN_LOSS else None)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise MessageError(f"{key} {shown(value)} is not a finite number")
        bound = MAX_SECONDS if key == REFRESH_SECONDS else MAX_LOSS  # finite is not enough (fedmvp_formats.bounds)
        if abs(value) > bound:
            raise MessageError(f"{key} {shown(value)} is not within -{bound:g} to {bound:g}")


def read_class_counts(record: Any) -> dict[str, int]:
    """A train reply's ``classes`` record: each class name it trained on -> its training images (a
    non-negative int, not a bool). Which names a node may claim, and that they add up to its
    ``num-examples``, is the server's rule (``fedmvp.federated.replies``)."""
    if not isinstance(record, Mapping):
        raise MessageError(f"the {CLASSES} record is not a mapping of class names to image counts")
    for name, count in record.items():
        if not isinstance(name, str) or not is_int(count) or count < 0:
            raise MessageError(f"{CLASSES} {name_shown(str(name))}: {shown(count)} is not a count of images")
    return dict(record)


def count_metrics(counts: Mapping[str, tuple[int, int]]) -> dict[str, int]:
    """Evaluation counts as metrics: ``<set>:correct`` and ``<set>:total`` per set."""
    return {f"{name}:{part}": int(value) for name, pair in counts.items()
            for part, value in zip(("correct", "total"), pair)}


def count_sets(metrics: Mapping[str, Any]) -> set[str]:
    """The sets whose counts ``metrics`` reports."""
    return {key.rpartition(":")[0] for key in metrics if key.endswith(":correct")}


def count_pair(metrics: Mapping[str, Any], name: str) -> tuple[int, int] | None:
    """(correct, total) of ``name`` when both are ints (not bools, not floats) with 0 <= correct <= total."""
    correct, total = metrics.get(f"{name}:correct"), metrics.get(f"{name}:total")
    if is_int(correct) and is_int(total) and 0 <= correct <= total:
        return correct, total
    return None
