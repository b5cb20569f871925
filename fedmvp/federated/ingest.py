"""`fedmvp ingest`: update files of devices that trained offline become the run's next round.

A device runs `edge-client train --data local/` on a bundle exported from some round and syncs
its update file (edge_client/update.py: the bundle's LoRA tensors + string metadata) later. Each
file is as untrusted as a network reply (the one tensor check, ``fedmvp_formats.tensors``, and
``replies.py``'s norm bound): it is checked, and a rejected file gets a reason and changes nothing.
Each accepted file is a delta against the LoRA of the round its bundle came from (``bundle_round``,
whose checkpoint the run keeps), and round R+1's LoRA is round R's plus ``server_lr`` times the
example- and staleness-weighted mean of those deltas (``fedmvp.federated.aggregate``: t = R minus
the bundle's round, s(t) = (1 + t)^(-staleness_exponent); with every file fresh, FedAvg of their
values, as before). Under ``[privacy]`` the deltas are clipped and noised there (central) or were
noised by the devices (local), and the round's epsilon is charged first (``privacy_budget``: a round
past ``max_epsilon`` is refused). Every other tensor is round R's, bit for bit. The round is written by
the run's round lifecycle (``round_writer.RoundWriter``, as an online round is): charged, the run's update
rule, published whole (``RunDir.save_checkpoint``), then its metrics row; nothing is written when no
file is accepted. The run's lock
(``fedmvp.run_lock``) is held from reading round R to writing R+1, so two ingests of one run
never both build on R: the second is refused, or waits and builds on R+1.

The update format is read by ``fedmvp_formats.update``, the one reader the device uses too
(safetensors and its string metadata, nothing unpickled: the size cap, the header check, the
strict integer rule, the escaping). What is checked here is the run's: the round's LoRA names
and shapes, staleness, the run id, ``edge_max_examples``, the norm bound, and on content, not on
names: the PromptFormer the update was trained over (``promptformer_digest``) and the whole state it
started from (``base_digest``: PromptFormer and LoRA) must be this run's round ``bundle_round``'s, so
its staleness is that of a round it really started from, and the class set its labels index
(``classes_digest``, required) the run's (docs/security.md: an update trained over another run's
weights). One training counts once, whatever its metadata says: equal or nearly equal tensors, or a
region's rounds taken before, are duplicates (``ingest_duplicates``); under ``[privacy]`` a device (its
``device_id``) is one participant of a release (``ingest_devices``).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fedmvp_formats import update as fmt
from fedmvp_formats.names import LORA_PREFIX
from fedmvp_formats.shown import shown
from fedmvp_formats.tensors import shapes_of, tensor_problem
from fedmvp_formats.update import UpdateFormatError

from fedmvp.federated import ingest_duplicates as dupes
from fedmvp.federated.aggregate import Update
from fedmvp.federated.ingest_bases import BaseLoras
from fedmvp.federated.ingest_devices import newest_first, one_per_device
from fedmvp.federated.privacy_budget import run_events
from fedmvp.federated.replies import ReplyRules, bound_update
from fedmvp.federated.round_writer import RoundRecord, RoundWriter
from fedmvp.federated.wire import to_numpy_state, to_torch_state
from fedmvp.run_lock import run_lock
from fedmvp.runs import RunDir, RunError

SOURCE = "ingest"  # state.json "source" and the metrics row's "source" of an ingested round
MAX_REASON = 300  # a rejection reason is one line of at most this many characters


# The server rules an ingest applies (fedmvp/presets/server.py), recorded with the round it writes.
INGEST_RULES = ("max_staleness", "edge_max_examples", "count_cap", "max_update_norm", "max_update_rms", "update_norm_action",
                "staleness_exponent", "server_lr", "device_rule")
INGEST_SAMPLING_RATE = 1.0  # the server samples no sender of an update file: no amplification is claimed


def ingest_rules(run: RunDir, config: dict[str, Any], round_number: int,
                 max_staleness: int | None = None) -> ReplyRules:
    """What an update file must satisfy to count in round ``round_number + 1``: the run's recorded server
    rules (``RunDir.server``), ``max_staleness`` (`--max-staleness`) overriding the record's."""
    from fedmvp.run_classes import class_set

    server = run.server({"max_staleness": max_staleness}, "--max-staleness")
    classes = run.class_set()
    return ReplyRules(run_id=config.get("run_id"), round=round_number, server=server,
                      classes_digest=None if classes is None else class_set(classes).digest)


@dataclass
class FileVerdict:
    """One update file's outcome; ``record()`` is what state.json keeps of it."""

    file: str
    sha256: str | None = None
    reason: str | None = None  # why it was rejected (None: accepted)
    num_examples: int | None = None
    bundle_round: int | None = None
    bundle_id: str | None = None
    mean_loss: float | None = None
    clipped_from: float | None = None  # its update norm, when it was clipped onto max_update_norm
    staleness: int | None = None  # rounds between its bundle's round and the round it is applied to
    s: float | None = None  # s(t), its staleness weight
    weight: float | None = None  # the share of its delta that reached the LoRA (aggregate.apply_updates)
    images_digest: str | None = None  # the images it trained on (update file ``images_digest``)
    created: str = ""  # when the device wrote it: of two over the same images, the newer counts
    base_digest: str | None = None  # the state it names as its base, verified to be round bundle_round's
    device_id: str | None = None  # the device that trained it (under [privacy]: one update per device a release)
    region: dict[str, Any] = field(default_factory=dict)  # a region's file: region_run_id, region_rounds
    content: dict[str, Any] = field(default_factory=dict)  # its training's identity (ingest_duplicates)
    arrays: dict[str, np.ndarray] | None = field(default=None, repr=False)

    @property
    def accepted(self) -> bool:
        return self.arrays is not None

    def record(self) -> dict[str, Any]:
        return {"file": self.file, "sha256": self.sha256, "accepted": self.accepted, "reason": self.reason,
                "num_examples": self.num_examples, "bundle_round": self.bundle_round,
                "bundle_id": self.bundle_id, "mean_loss": self.mean_loss, "clipped_from": self.clipped_from,
                "staleness": self.staleness, "s": self.s, "weight": self.weight, "images_digest": self.images_digest,
                "base_digest": self.base_digest, "device_id": self.device_id, "created": self.created or None,
                **self.region,
                **dict.fromkeys(dupes.RECORD_KEYS), **self.content}

    def identity(self) -> dict[str, Any]:
        """What tells its training from another's (`ingest_duplicates`): the record's identity keys."""
        return {"file": self.file, "sha256": self.sha256, "created": self.created, **self.region, **self.content}


@dataclass
class IngestResult:
    """What one ingest did: the round written (None: nothing accepted, nothing written) and every file."""

    run: Path
    base_round: int
    round: int | None
    files: list[FileVerdict]
    examples: int = 0
    mean_loss: float | None = None

    @property
    def accepted(self) -> list[FileVerdict]:
        return [v for v in self.files if v.accepted]

    @property
    def rejected(self) -> list[FileVerdict]:
        return [v for v in self.files if not v.accepted]

    def to_json(self) -> dict[str, Any]:
        return {"run": str(self.run), "base_round": self.base_round, "round": self.round,
                "examples": self.examples, "mean_loss": self.mean_loss,
                "accepted": [v.record() for v in self.accepted], "rejected": [v.record() for v in self.rejected]}


class _Rejected(Exception):
    """Internal: the reason a file is left out."""


def ingest(run: RunDir | str | Path, files: Sequence[str | Path], *, max_staleness: int | None = None,
           wait: float = 0.0, break_lock: bool = False) -> IngestResult:
    """Check ``files`` against the run's last round R and write round R+1 from the accepted ones.

    ``RunError`` (nothing written): no run, no complete round, a round without LoRA, no files;
    `RunBusy` when another process holds the run's lock (``RUN/.lock``) for longer than ``wait``
    seconds (``math.inf``: as long as it takes). ``max_staleness`` overrides config.json's
    ``server.max_staleness``; ``break_lock``: take over a lock whose record names another host."""
    run = run if isinstance(run, RunDir) else RunDir(run)
    config = run.read_config()
    if not files:
        raise RunError(f"{run.path}: no update files given")
    with run_lock(run.path, "fedmvp ingest", wait, break_lock=break_lock):
        return _ingest_locked(run, config, files, max_staleness)


def _ingest_locked(run: RunDir, config: dict[str, Any], files: Sequence[str | Path],
                   max_staleness: int | None) -> IngestResult:
    """`ingest` with the run's lock held: no one else writes a round between reading R and writing R+1."""
    began = time.monotonic()
    base = run.last_round()
    if base is None:
        raise RunError(f"{run.path}: no complete round to add updates to")
    checkpoint = run.load_checkpoint(base)
    lora = to_numpy_state({k: v for k, v in checkpoint.tensors.items() if k.startswith(LORA_PREFIX)})
    if not lora:
        raise RunError(f"{run.round_path(base)}: round {base} holds no {LORA_PREFIX}* tensors (use_lora = false): "
                       f"edge updates have nothing to go into")
    rules = ingest_rules(run, config, base, max_staleness)
    seen, taken = accepted_before(run), dupes.Taken(accepted_records(run))
    bases = BaseLoras(run, base, lora, checkpoint.tensors)
    verdicts = []
    for path in files:
        verdict = check_file(Path(path), rules, lora, seen, bases, taken)
        if verdict.sha256 is not None:
            seen.setdefault(verdict.sha256, f"given earlier in this command ({verdict.file})")
        verdicts.append(verdict)
    count_images_once(verdicts)
    privacy = run.privacy()
    if privacy is not None:  # one participant per device (ingest_devices), before one training's copies are
        one_per_device(verdicts, MAX_REASON)  # resolved: a copy under another id must not let an older file in
    count_trainings_once(verdicts)
    result = IngestResult(run=run.path, base_round=base, round=None, files=verdicts)
    accepted = sorted(result.accepted, key=lambda v: v.sha256 or "")  # argument order must not change the sums
    if not accepted:
        return result
    writer = RoundWriter(run, rules.server, privacy, run_events(run) if privacy is not None else (),
                         fail=lambda line: RunError(f"{run.path}: {line}"))
    spent = writer.charge(INGEST_SAMPLING_RATE, base + 1)
    updates = [Update(v.arrays, int(v.num_examples), base - int(v.bundle_round),
                      None if v.bundle_round == base else bases(int(v.bundle_round))) for v in accepted]
    # an update file has no node id: its screened entries name the file, as its "ingest" entry does
    step = writer.apply(f"round {base + 1}", lora, updates, [(v.file, "edge") for v in accepted])
    for verdict, weight, clipped in zip(accepted, step.weights, step.clipped):
        verdict.staleness, verdict.s, verdict.weight = weight["staleness"], weight["s"], weight["weight"]
        verdict.clipped_from = verdict.clipped_from if clipped is None else clipped
    result.examples = sum(int(v.num_examples) for v in accepted)
    result.mean_loss = sum(float(v.mean_loss) * int(v.num_examples) for v in accepted) / result.examples
    result.round = base + 1
    row = {"round": result.round, "source": SOURCE, "updates": len(accepted), "examples": result.examples,
           "train_loss": result.mean_loss, **({"epsilon": spent["epsilon"]} if spent else {})}
    carried = {k: v for k, v in checkpoint.state.items() if k not in ("round", "complete", "privacy", "not_private")}
    # Those describe a Flower round's replies: round R's sites did not train round R+1 (an open federation's
    # sites by id and name, in state.json "replies"); the round's senders are its update files ("ingest").
    carried |= {key: [] for key in ("sites", "rejected", "replies") if key in carried}
    record = RoundRecord(result.round, row, carried=carried, seconds=time.monotonic() - began,
                         ingest={"source": SOURCE, "ingested_onto": base, "ingest_rules": rules.server.subset(
                             INGEST_RULES), "ingest": [v.record() for v in verdicts]},
                         privacy=writer.released(spent, step, result.round, None).get("privacy"),
                         screened=writer.screened(step))
    writer.save(record, {**checkpoint.tensors, **to_torch_state(step.tensors)}, replace=False)
    return result


def count_images_once(verdicts: list[FileVerdict]) -> None:
    """Of accepted updates over the same images (one ``images_digest``: one device's two trainings, say),
    only the newest counts in the round; the others are rejected with one line, so the images' examples
    weigh once (docs/howto/ingest.md). Which one is kept depends on the files, never on argument order."""
    groups: dict[str, list[FileVerdict]] = {}
    for verdict in verdicts:
        if verdict.accepted and verdict.images_digest:
            groups.setdefault(verdict.images_digest, []).append(verdict)
    for digest, group in groups.items():
        kept, *others = newest_first(group)
        for verdict in others:
            verdict.arrays = None
            verdict.reason = (f"same images as {kept.file} (images_digest {digest[:12]}), which is newer: "
                              f"their examples count once")[:MAX_REASON]


def count_trainings_once(verdicts: list[FileVerdict]) -> None:
    """Of accepted files that are one training (equal or nearly equal tensors) or overlap one region's rounds,
    only one counts (`ingest_duplicates.keep_one`: the newest); the others are rejected with one line."""
    accepted = [v for v in verdicts if v.accepted]
    for index, reason in dupes.keep_one([v.identity() for v in accepted]).items():
        accepted[index].arrays = None
        accepted[index].reason = reason[:MAX_REASON]


def accepted_records(run: RunDir) -> list[tuple[int, dict[str, Any]]]:
    """(round, record) of every file an earlier ingest of the run accepted (their state.json)."""
    return [(number, record) for number in run.rounds() for record in run.round_state(number).get("ingest") or []
            if record.get("accepted")]


def accepted_before(run: RunDir) -> dict[str, str]:
    """sha256 -> where it was accepted, over every earlier ingest of the run (its rounds' state.json)."""
    seen: dict[str, str] = {}
    for number in run.rounds():
        for record in run.round_state(number).get("ingest") or []:
            if record.get("accepted") and record.get("sha256"):
                seen.setdefault(record["sha256"], f"accepted in round {number} ({record.get('file')})")
    return seen


def check_file(path: Path, rules: ReplyRules, lora: dict[str, np.ndarray], seen: dict[str, str],
               bases: BaseLoras | None = None, taken: dupes.Taken | None = None) -> FileVerdict:
    """One update file judged against round ``rules.round``'s LoRA ``lora``; ``seen``: sha256s refused as
    duplicates; ``bases``: the LoRA of the round its bundle came from, which its norm bound is measured
    from (None: ``lora`` for every round); ``taken``: the run's accepted files, which the same training is
    refused against (`ingest_duplicates.Taken`; None: none). The checks run in order and the first that fails is the reason: one line, at most
    ``MAX_REASON`` characters, what the file says escaped (``fedmvp_formats.shown``)."""
    verdict = FileVerdict(file=str(path))
    try:
        try:
            data = fmt.read_bounded(path, fmt.size_limit(v.shape for v in lora.values()), f"round {rules.round}")
            verdict.sha256 = hashlib.sha256(data).hexdigest()
            if verdict.sha256 in seen:
                raise _Rejected(f"duplicate: the same file was {seen[verdict.sha256]}")
            tensors, metadata = fmt.parse_update(data)
        except UpdateFormatError as err:
            raise _Rejected(str(err)) from None
        verdict.bundle_id, verdict.bundle_round = metadata["bundle_id"], metadata["bundle_round"]
        verdict.num_examples, verdict.mean_loss = metadata["num_examples"], metadata["mean_loss"]
        verdict.images_digest, verdict.created = metadata.get("images_digest"), str(metadata["created"])
        verdict.base_digest, verdict.device_id = metadata.get("base_digest"), metadata.get("device_id")
        if metadata.get("region_run_id"):
            verdict.region = {"region_run_id": str(metadata["region_run_id"]),
                              "region_rounds": metadata.get("region_rounds")}
        problem = tensor_problem(tensors, shapes_of(lora))
        if problem is not None:
            raise _Rejected(problem)
        arrays = {k: tensors[k].astype(np.float32) for k in sorted(tensors)}  # native byte order
        _check_run(metadata, rules)
        try:
            base = lora if bases is None else bases(metadata["bundle_round"])
            _check_content(metadata, rules, bases)
        except RunError as err:
            raise _Rejected(str(err)) from None
        problem = tensor_problem(tensors, shapes_of(base))
        if problem is not None:
            raise _Rejected(f"against round {metadata['bundle_round']}: {problem}")
        verdict.content = dupes.content_record(arrays, base)
        repeated = None if taken is None else taken.why_again(verdict.identity())
        if repeated is not None:
            raise _Rejected(repeated)
        kept, reason, verdict.clipped_from = bound_update(arrays, base, rules.server)
        if reason is not None:
            raise _Rejected(reason)
        verdict.arrays = kept
    except _Rejected as rejected:
        reason = str(rejected)
        verdict.reason = reason if len(reason) <= MAX_REASON else reason[:MAX_REASON - 3] + "..."
    return verdict


def _check_content(metadata: dict[str, Any], rules: ReplyRules, bases: BaseLoras | None) -> None:
    """Where its weights came from, on content: the PromptFormer it was trained over is this run's round
    ``bundle_round``'s (a bundle that joined another run carries that run's), and the class set it
    names is the run's. A run id is a name anyone can write; a digest is of the weights themselves."""
    said, bundle_round = metadata.get("promptformer_digest"), metadata["bundle_round"]
    if not said:
        raise _Rejected("names no PromptFormer it was trained over (promptformer_digest; an older edge-client's "
                        "file): train it again with this edge-client on a bundle of this run")
    if bases is not None and said != bases.promptformer(bundle_round):
        raise _Rejected(f"trained over PromptFormer {said[:12]}, not over this run's round {bundle_round} "
                        f"({bases.promptformer(bundle_round)[:12]}): its weights come from another run or round")
    if bases is not None:
        _check_base(metadata, rules, bases)
    classes = metadata.get("classes_digest")
    if rules.classes_digest and not classes:
        raise _Rejected("names no class set (classes_digest): its labels could index any classes; train it again "
                        "with this edge-client on a bundle of this run")
    if classes and rules.classes_digest and classes != rules.classes_digest:
        raise _Rejected(f"trained on another class set (classes_digest {classes[:12]}, this run's is "
                        f"{rules.classes_digest[:12]}): its bundle was exported with other classes or phrases")


def _check_base(metadata: dict[str, Any], rules: ReplyRules, bases: BaseLoras) -> None:
    """The state it was trained from, on content: its ``base_digest`` is round ``bundle_round``'s state
    (PromptFormer and LoRA). The round number alone is a claim (an ingest round keeps the PromptFormer, so
    a file re-saved with the next round's number passed as fresh); the state it names is the base, and
    its staleness is that round's."""
    said, claimed = metadata.get("base_digest"), metadata["bundle_round"]
    if not said:
        raise _Rejected("names no base state (base_digest; an older edge-client's file): train it again with this "
                        "edge-client on a bundle of this run")
    if said == bases.state(claimed):
        return
    window = range(max(0, rules.round - rules.server.max_staleness), rules.round + 1)
    found = bases.find(said, window)
    if found is not None:
        raise _Rejected(f"bundle_round {claimed}, but its base_digest is round {found}'s state: its round was "
                        f"rewritten, the update counts nowhere")
    raise _Rejected(f"its base (base_digest {said[:12]}) is the state of none of this run's rounds "
                    f"{window.start}-{window.stop - 1}: trained from a round since replaced, or from another run")


def _check_run(metadata: dict[str, Any], rules: ReplyRules) -> None:
    """The run's rules (the format's are checked by ``fedmvp_formats.update``): a bundle exported from a
    round of this run, not newer than its last nor staler than ``max_staleness``, and a FedAvg weight
    within ``edge_max_examples``."""
    examples, bundle_round = metadata["num_examples"], metadata["bundle_round"]
    if bundle_round is None or bundle_round < 0:
        raise _Rejected(f"bundle_round {shown(metadata['bundle_round'])} is not a round number "
                        f"(the bundle was not exported from a run's round)")
    if examples > rules.server.edge_max_examples:
        raise _Rejected(f"num_examples {examples} exceeds edge_max_examples ({rules.server.edge_max_examples})")
    behind = rules.round - bundle_round
    if behind < 0:
        raise _Rejected(f"bundle round {bundle_round} is newer than the run's last round {rules.round}")
    if behind > rules.server.max_staleness:
        raise _Rejected(f"stale: bundle round {bundle_round} is {behind} round{'s' * (behind != 1)} behind "
                        f"round {rules.round} (max_staleness {rules.server.max_staleness})")
    run_id = metadata.get("run_id") or None
    if run_id is not None and run_id != rules.run_id:
        raise _Rejected(f"update of another run (run_id {shown(run_id)}, this run's is {shown(rules.run_id)})")
