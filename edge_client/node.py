"""An edge device as a node of the federation: the train and evaluate handlers of its ClientApp.

``edge-client join`` starts a Flower SuperNode whose node config says ``role='edge'`` and where
the bundle and the local images are; the federation's ClientApp (``node_app.client_app``)
hands this module every message such a node receives. Nothing of ``fedmvp`` is needed: the
round trains with the same code as ``edge-client train`` (``edge_client.train.train_local``:
the bundle's training program and method config, the memory budget, batch auto-fit).

Each train message carries the global tensors and the digest of the global PromptFormer
(``promptformer-digest``). A device whose bundle holds another PromptFormer (stale: the server
has trained it since the export) refreshes the bundle in place from the message's
``promptformer.*`` tensors first (``edge_client.refresh``), then trains the global LoRA on its
training share of ``data`` and replies with the LoRA tensors, its number of examples and its
bundle id; under the run's ``[privacy]`` (the message's ``privacy`` record) its delta is clipped, and
in local mode noised, first (docs/howto/privacy.md). Images never leave the device. The trained tensors come back from the training in
memory (`TrainResult.tensors`, checked against the bundle as an update file is); an update file
is written too only where the node config's ``out`` asks for one. With ``personalise`` the result also becomes the
device's own active LoRA; by default the device's personal LoRA is left alone.

Evaluate messages: the global model (refreshed first when stale) on the held-out share of
``data`` (or ``eval-data``), on the runtime and precision the node config names (``edge-client join
--runtime/--precision``, chosen as ``edge-client infer`` chooses them); only the counts go back. The
node's process stays warm across rounds, and so does its inference session (one per bundle state and
runtime; the round's LoRA is fed per run) and its training program
(``edge_client.program.load_program``); a refresh gives the bundle a new id, and new ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from logging import INFO
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore import log

from fedmvp_formats import messages as schema
from fedmvp_formats.class_set import read_class_set
from fedmvp_formats.envelope import RECORD, fold, read_envelope
from fedmvp_formats.messages import Identity, Instruction, read_instruction
from fedmvp_formats.names import LORA_PREFIX, PROMPTFORMER_PREFIX
from fedmvp_formats.packed import LAYOUT, packed_records, read_wire
from fedmvp_formats.privacy import PrivacyRecord, device_privacy
from fedmvp_formats.promptformer import promptformer_digest
from fedmvp_formats.shown import name_shown, path_shown

from edge_client.bundle import Bundle, BundleError
from edge_client.local_data import LocalDataset, held_out_split, scan_folder
from edge_client.lora_store import ActiveLora, PersonalisationError, active_lora, reapply
from edge_client.refresh import recover_refresh, refresh_bundle
from edge_client.train_options import TrainInputError, TrainOptions

ROLE = schema.EDGE
DEFAULT_EVAL_FRACTION = 0.2
PARITY_IMAGES = 4  # local images a refresh checks ONNX Runtime against the training program on


@dataclass(frozen=True)
class EdgeNodeConfig:
    """What an edge node is, from its Flower node config (written by ``edge-client join``)."""

    bundle: Path
    data: Path
    eval_data: Path | None = None
    eval_fraction: float = DEFAULT_EVAL_FRACTION
    out: Path | None = None  # where each round's update file is kept; None: none is (the reply carries the LoRA)
    personalise: bool = False
    device: str = "auto"
    max_memory_gb: float | None = None
    epochs: int = 1
    lr: float = float(TrainOptions.default("lr"))
    optimizer: str = str(TrainOptions.default("optimizer"))
    batch_size: int | str = "auto"
    threads: int | None = None
    runtime: str = "ort"  # what evaluates the global model: `edge-client infer --runtime` (edge_client/engines.py)
    precision: str = "auto"

    # node-config key -> field; numbers travel as numbers, paths and words as strings
    KEYS = {"bundle": "bundle", "data": "data", "eval-data": "eval_data", "eval-fraction": "eval_fraction",
            "out": "out", "personalise": "personalise", "device": "device", "max-memory-gb": "max_memory_gb",
            "epochs": "epochs", "lr": "lr", "optimizer": "optimizer", "batch-size": "batch_size",
            "threads": "threads", "runtime": "runtime", "precision": "precision"}

    @classmethod
    def from_node_config(cls, config: Any) -> EdgeNodeConfig:
        values = {field: config[key] for key, field in cls.KEYS.items() if key in config and config[key] != ""}
        for key in ("bundle", "data"):
            if key not in values:
                raise RuntimeError(f"edge node without {key}: start it with `edge-client join --bundle DIR --data DIR`")
        for key in ("bundle", "data", "eval_data", "out"):
            if key in values:
                values[key] = Path(str(values[key]))
        if "batch_size" in values and str(values["batch_size"]) != "auto":
            values["batch_size"] = int(values["batch_size"])
        return cls(**values)

    def to_node_config(self) -> str:
        """The ``--node-config`` text of ``flower-supernode`` (role first, empty values left out)."""
        parts = [f"role={ROLE!r}"]
        for key, field in self.KEYS.items():
            value = getattr(self, field)
            if value is None:
                continue
            if isinstance(value, bool):
                parts.append(f"{key}={'true' if value else 'false'}")
            elif isinstance(value, (int, float)):
                parts.append(f"{key}={value!r}")
            else:
                parts.append(f"{key}={str(value)!r}")
        return " ".join(parts)

    def options(self, round_number: int) -> TrainOptions:
        """`edge-client train`'s options for one round (the seed follows the round)."""
        return TrainOptions(epochs=self.epochs, batch_size=self.batch_size, max_memory_gb=self.max_memory_gb,
                            out=self.out, lr=self.lr, optimizer=self.optimizer, device=self.device,
                            seed=round_number, apply=self.personalise, threads=self.threads)

    def shares(self, bundle: Bundle) -> tuple[LocalDataset, LocalDataset]:
        """(training share, held-out share) of the local images."""
        data = scan_folder(self.data, bundle.class_names)
        if self.eval_data is not None:
            return data, scan_folder(self.eval_data, bundle.class_names)
        return held_out_split(data, self.eval_fraction)


# ---- the global tensors and the bundle ---------------------------------------------------------------
def _records(content: RecordDict) -> dict[str, dict[str, Any]]:
    """The schema's records of a message: its one ConfigRecord, unfolded (``fedmvp_formats.envelope``)."""
    return read_envelope(content, content.config_records)


def _arrays(content: RecordDict) -> dict[str, np.ndarray]:
    """The tensors the server sent, packed (``fedmvp_formats.packed``), judged before use."""
    records = _records(content)
    return read_wire(records.get(schema.ARRAYS), records.get(LAYOUT))


@dataclass
class Synced:
    """The bundle after it was brought to the server's PromptFormer, and what that cost."""

    bundle: Bundle
    refreshed: bool = False
    refresh_bytes: int = 0
    refresh_seconds: float = 0.0
    personal: str | None = None  # what the refresh did with the device's personalised LoRA (one line), if any


def sync_bundle(node: EdgeNodeConfig, arrays: dict[str, np.ndarray], digest: str, round_number: int,
                check_images: list[Path], run_id: str | None = None, class_set: dict | None = None) -> Synced:
    """The node's bundle holding the PromptFormer whose digest is ``digest``: as it is, or refreshed
    from the message's ``promptformer.*`` tensors (the bundle then is the global model of
    ``round_number`` of run ``run_id``; the previous one is kept in ``bundle/previous``). A bundle whose
    class set is not the run's (``class_set``, the message's record) is refused first."""
    recover_refresh(node.bundle)
    bundle = Bundle.open(node.bundle, verify=True)
    bundle.require_trainable()
    check_class_set(bundle, class_set, run_id)
    if bundle.promptformer_digest == digest:
        return Synced(bundle)
    sent = {k: v for k, v in arrays.items() if k.startswith((PROMPTFORMER_PREFIX, LORA_PREFIX))}
    if not any(k.startswith(PROMPTFORMER_PREFIX) for k in sent):
        raise BundleError(f"{bundle.path}: holds PromptFormer {str(bundle.promptformer_digest)[:12]}, the round's is "
                          f"{digest[:12]}, and the message carries no PromptFormer to refresh it with")
    personalised = _personalised(bundle)  # read now: the refresh moves it to previous/
    result = refresh_bundle(bundle, sent, digest=digest, round_number=round_number,
                            check_images=check_images[:PARITY_IMAGES], run_id=run_id)
    log(INFO, "edge: bundle %s refreshed to the PromptFormer of round %s (%s -> %s, %d bytes, %.1f s)",
        bundle.path, round_number, result.old_id[:12], result.new_id[:12], result.bytes_received, result.seconds)
    refreshed = Bundle.open(node.bundle, verify=True)
    personal = None if personalised is None else carry_personalised(node, personalised, refreshed, round_number)
    return Synced(refreshed, True, result.bytes_received, result.seconds, personal)


def _personalised(bundle: Bundle) -> ActiveLora | None:
    """The device's personalised LoRA, when inference runs one (a corrupt state: none to carry over)."""
    try:
        active = active_lora(bundle)
    except PersonalisationError:
        return None
    return active if active.personalised else None


def carry_personalised(node: EdgeNodeConfig, moved: ActiveLora, bundle: Bundle, round_number: int) -> str:
    """What becomes of the personalised LoRA a refresh moved aside, said in one logged line: with
    ``personalise`` (`edge-client join --personalise`) it is re-applied on the refreshed bundle, so the
    device always ends with its own LoRA; otherwise it stays in previous/ (docs/howto/refresh.md)."""
    kept = path_shown(Path(bundle.path) / "previous" / "personalised" / moved.file.name)
    if node.personalise:
        active = reapply(moved, bundle)
        line = (f"edge: the refresh to round {round_number} moved the personalised LoRA aside ({kept}); "
                f"re-applied on the refreshed bundle as {active.file.name} (--personalise)")
    else:
        line = (f"edge: the refresh to round {round_number} moved the personalised LoRA aside ({kept}); inference "
                f"now runs the round's LoRA (edge-client rollback --refresh brings it back)")
    log(INFO, "%s", line)
    return line


def check_class_set(bundle: Bundle, class_set: dict | None, run_id: str | None) -> None:
    """Refuse (one line) a bundle whose class set is not the run's: its labels would be other indices
    (docs/security.md). Only where both say theirs: an older bundle or run records none."""
    if class_set is None or bundle.classes_digest is None:
        return
    try:
        run = read_class_set(class_set)
    except ValueError as err:
        raise BundleError(f"the server's message: {err}") from None
    if run.digest != bundle.classes_digest:
        names, theirs = list(bundle.class_names), list(run.names)
        what = "other attribute phrases" if names == theirs else \
            "other class order" if set(names) == set(theirs) else "other classes"
        raise BundleError(f"{bundle.path}: refused before training: the bundle's class set is not run "
                          f"{name_shown(str(run_id))}'s ({what}); export a bundle from that run (fedmvp-export)")


def _identity(instruction: Instruction, synced: Synced | None = None) -> dict[str, Any]:
    """Who replies: an edge device, its bundle, for this run and round (checked by the server)."""
    bundle = {} if synced is None else {
        "bundle_id": synced.bundle.id, "promptformer_digest": str(synced.bundle.promptformer_digest),
        "refreshed": synced.refreshed, "refresh_bytes": synced.refresh_bytes,
        "classes_digest": synced.bundle.classes_digest}
    return Identity(round=instruction.round, run_id=instruction.run_id, **bundle).record()


def _instruction(msg: Message) -> Instruction:
    """The server's instruction, every value checked (``fedmvp_formats.messages``)."""
    return read_instruction(_records(msg.content))


def _reply(msg: Message, instruction: Instruction, synced: Synced | None, metrics: dict,
           arrays: dict[str, np.ndarray] | None = None) -> Message:
    records = {schema.METRICS: metrics, schema.IDENTITY: _identity(instruction, synced)}
    if arrays is not None:  # the reply's tensors as the server reads them: packed bytes and their layout
        records = {**packed_records(arrays), **records}
    return Message(content=_content(records), reply_to=msg)


def _content(records: dict[str, dict[str, Any]]) -> RecordDict:
    """``records`` folded into one ConfigRecord: a message of 3 Flower objects (``fedmvp_formats.envelope``)."""
    return RecordDict({RECORD: ConfigRecord(fold(records))})


def _global_lora(arrays: dict[str, np.ndarray], bundle: Bundle) -> dict[str, np.ndarray]:
    lora = {k: v for k, v in arrays.items() if k.startswith(LORA_PREFIX)}
    if set(lora) != set(bundle.lora_shapes):
        raise BundleError(f"{bundle.path}: the round's LoRA tensors ({len(lora)}) are not the bundle's "
                          f"({len(bundle.lora_shapes)}); was the bundle exported from this federation's run?")
    return lora


# ---- the handlers --------------------------------------------------------------------------------------
def identify(msg: Message, context: Context) -> Message:
    """Who this node is, asked once by the server before any work: an edge device of this run."""
    return Message(content=_content({schema.IDENTITY: _identity(_instruction(msg))}), reply_to=msg)


def train(msg: Message, context: Context) -> Message:
    """One round on the device: sync the bundle, train the global LoRA locally, reply with it."""
    from edge_client.train import train_local

    node = EdgeNodeConfig.from_node_config(context.node_config)
    instruction = _instruction(msg)
    round_number = instruction.round
    arrays = _arrays(msg.content)
    bundle = Bundle.open(node.bundle, verify=False)
    training, _ = node.shares(bundle)
    synced = sync_bundle(node, arrays, instruction.promptformer_digest, round_number - 1, training.files,
                         instruction.run_id, instruction.class_set)
    start = _global_lora(arrays, synced.bundle)
    log(INFO, "edge: round %s, training the global LoRA on %d local images", round_number, len(training))
    sent = None if instruction.privacy is None else \
        PrivacyRecord.from_record(instruction.privacy, "the server's privacy record")  # the run's
    privacy = device_privacy(synced.bundle.privacy, sent)  # the bundle's local noise: a floor the server cannot lower
    result = train_local(training, synced.bundle, node.options(round_number), start_lora=start, privacy=privacy,
                         start_round=round_number - 1)  # the version sent: an update file kept names it (--out)
    trained = result.tensors  # in memory, checked against the bundle as an update file would be
    metrics = schema.train_metrics(result.num_examples, result.mean_loss, refresh_seconds=synced.refresh_seconds)
    return _reply(msg, instruction, synced, metrics, trained)


def evaluate(msg: Message, context: Context) -> Message:
    """The global model on the device's held-out images: top-1 counts (``edge:correct``, ``edge:total``)."""
    node = EdgeNodeConfig.from_node_config(context.node_config)
    instruction = _instruction(msg)
    arrays = _arrays(msg.content)
    if not instruction.prompted or not arrays:  # zero-shot CLIP: the bundle cannot run it
        return _reply(msg, instruction, None, {})
    digest = instruction.promptformer_digest or promptformer_digest(arrays)
    bundle = Bundle.open(node.bundle, verify=False)
    training, held_out = node.shares(bundle)
    synced = sync_bundle(node, arrays, digest, instruction.round, training.files, instruction.run_id,
                         instruction.class_set)
    lora = ActiveLora(tensors=_global_lora(arrays, synced.bundle), source="global", file=synced.bundle.path)
    predictor = _warm_predictor(synced.bundle, node.threads, node.runtime, node.precision)
    predictor.use_lora(lora)
    correct, total = evaluate_share(predictor, held_out)
    log(INFO, "edge: round %s, global model %d/%d correct on held-out images", instruction.round, correct, total)
    return _reply(msg, instruction, synced, schema.count_metrics({schema.EDGE_SET: (correct, total)}))


_PREDICTORS: dict[tuple[str, str, int | None, str, str], Any] = {}


def _warm_predictor(bundle: Bundle, threads: int | None, runtime: str = "ort", precision: str = "auto") -> Any:
    """One session per bundle state and runtime, kept across rounds (the node's process stays warm:
    fedmvp_apps/deploy/warm_executor.py); a refresh gives the bundle a new id, and so a new session.
    ``runtime`` / ``precision``: `edge-client join --runtime/--precision`, chosen as `infer` chooses
    (``edge_client.runtime_choice.choose``; auto's verdict is cached per bundle and machine).
    Only the newest is kept: a device holds one bundle."""
    from edge_client.infer import Predictor

    key = (str(bundle.path.resolve()), bundle.id, threads, runtime, precision)
    if key not in _PREDICTORS:
        _PREDICTORS.clear()
        predictor = Predictor(bundle, threads=threads, personalised=False, runtime=runtime, precision=precision)
        log(INFO, "edge: %s", predictor.choice.line)
        _PREDICTORS[key] = predictor
    return _PREDICTORS[key]


def evaluate_share(predictor: Any, share: LocalDataset) -> tuple[int, int]:
    """(top-1 correct, images read) of ``predictor`` on ``share``; unreadable images are not counted."""
    if not share.files:
        raise TrainInputError(f"{share.root}: no held-out images to evaluate on (give --eval-data or more "
                              f"images per class)")
    truth = {Path(path).resolve(): predictor.classes[label] for path, label in zip(share.files, share.labels)}
    result = predictor.infer(share.files)
    correct = sum(int(p.label == truth.get(Path(p.path).resolve())) for p in result.predictions)
    return correct, len(result.predictions)
