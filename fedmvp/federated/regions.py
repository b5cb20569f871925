"""Regions: a regional run's progress enters a central run as one update file (docs/howto/regions.md).

Where one server is not enough, each region runs its own federation (served, buffered, ingested or
simulated: any run kind, since only its checkpoints are read) and the central run takes each region's
progress as ONE update, through `fedmvp ingest`, checked as a device's file is. Two steps:

* `region_start`: the region's run is made from the central run's round R: its records (config.json
  with a run id of its own and a round budget of its own, the class set, the preset copy) and round R's
  folder, bit for bit, plus
  ``region.json``, the link back (the central run's id, R, the sha256 of R's ``global.safetensors``,
  R's PromptFormer digest, the central ``edge_max_examples`` and the region's round budget N). A region
  has its own run id, so its devices' update files and replies can never be mistaken for the central
  run's. Its config.json ``rounds`` is R + N: a served run counts rounds (or buffered versions) from 1,
  so `fedmvp serve` resumed on the region writes rounds R+1..R+N and stops (the central run's own
  ``rounds`` would leave a region started from a finished central run nothing to serve).
* `region_update`: the region's last round L against round R. An update file's tensors are values
  whose delta ingest takes against the LoRA of the central round it names (``bundle_round``); the
  region's round R is central round R bit for bit (checked on its sha256), so the file holds round L's
  LoRA and ingest's delta is exactly L - R. Its ``num_examples`` are the examples of the device updates
  the region's rounds R+1..L took (their state.json records), its ``mean_loss`` their example-weighted
  ``train_loss``. The file names the central run (``run_id``), round R (``bundle_round``) and its state
  (``base_digest``: a central round R replaced since is no base any more), R's PromptFormer and the class
  set: ingest checks all of it, and ``edge_max_examples``, as for any file.

An update file carries only the LoRA: a region whose rounds moved the PromptFormer is refused (its
delta would be half of what it trained). A region's total examples may exceed the central run's
``[server] edge_max_examples``; `region_update` refuses such a file up front with the bound to raise
(the central ingest would reject it: nothing is bypassed).
"""

from __future__ import annotations

import hashlib
import math
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedmvp_formats import update as fmt
from fedmvp_formats.atomic import atomic_dir, write_bytes
from fedmvp_formats.files import RUN_CLASSES, RUN_CONFIG, RUN_PRESET_COPY
from fedmvp_formats.names import LORA_PREFIX, PROMPTFORMER_PREFIX
from fedmvp_formats.promptformer import base_digest, promptformer_digest

from fedmvp import atomic
from fedmvp.runs import RunDir, RunError, read_record

REGION_RECORD = "region.json"  # RUN/region.json: the central run and round a region started from
KEPT_FILES = (RUN_PRESET_COPY, RUN_CLASSES)  # the central run's records a region keeps as they are


@dataclass
class RegionLink:
    """What ``region.json`` records: the central round a region started from."""

    central_run: str
    central_run_id: str | None
    central_round: int
    checkpoint_sha256: str  # of the central round's global.safetensors: the base the region's copy must be
    promptformer_digest: str
    edge_max_examples: int  # the central run's [server] bound when the region started
    rounds: int | None = None  # the rounds (buffered: versions) the region serves after central_round

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _numpy(tensors: dict[str, Any], prefix: str) -> dict[str, np.ndarray]:
    return {k: v.detach().float().cpu().numpy() for k, v in sorted(tensors.items()) if k.startswith(prefix)}


def region_start(central: str | Path, out: str | Path, round_number: int | None = None,
                 rounds: int | None = None) -> RegionLink:
    """Make the regional run ``out`` from central round ``round_number`` (default: its last), to serve
    ``rounds`` rounds or versions after it (default: the central run's ``rounds``); ``RunError`` when the
    central run or the round is missing, the round holds no LoRA, ``rounds`` < 1, or ``out`` exists."""
    run, out = RunDir(central), Path(out)
    config = run.read_config()
    base = run.last_round() if round_number is None else round_number
    if base is None or base not in run.rounds():
        raise RunError(f"{run.path}: no complete round{'' if base is None else f' {base}'} to start a region from")
    budget = int(config.get("rounds") or 1) if rounds is None else rounds
    if budget < 1:
        raise RunError(f"{out}: a region serves at least 1 round after round {base}, not {budget}")
    if out.exists() or out.is_symlink():
        raise RunError(f"{out}: exists (a region starts in a new folder)")
    tensors = run.load_checkpoint(base).tensors
    if not _numpy(tensors, LORA_PREFIX):
        raise RunError(f"{run.round_path(base)}: round {base} holds no {LORA_PREFIX}* tensors: an update file "
                       f"carries only the LoRA, so a region has nothing to send")
    link = RegionLink(str(run.path.resolve()), config.get("run_id"), base, _sha256(run.round_weights_path(base)),
                      promptformer_digest(_numpy(tensors, PROMPTFORMER_PREFIX)), run.server().edge_max_examples,
                      budget)
    with atomic_dir(out) as tmp:
        for name in KEPT_FILES:
            if (run.path / name).is_file():
                shutil.copy2(run.path / name, tmp / name)
        shutil.copytree(run.round_path(base), tmp / run.round_path(base).name)
        atomic.write_json(tmp / RUN_CONFIG, {**config, "run_id": uuid.uuid4().hex,  # the region's own id
                                             "rounds": base + budget})  # serve resumes after R for N
        atomic.write_json(tmp / REGION_RECORD, link.to_json())
    if _sha256(out / run.round_path(base).relative_to(run.path) / run.ROUND_WEIGHTS) != link.checkpoint_sha256:
        raise RunError(f"{run.round_weights_path(base)}: changed while it was copied; start the region again")
    return link


def read_link(region: RunDir) -> RegionLink:
    """``region.json``, checked: a run made by `region_start`."""
    path = region.path / REGION_RECORD
    if not path.is_file():
        raise RunError(f"{path}: missing: not a region (make one with `fedmvp region-start`)")
    try:
        record = read_record(path)
        link = RegionLink(**{k: record[k] for k in RegionLink.__dataclass_fields__ if k != "rounds"},
                          rounds=record.get("rounds"))
    except (KeyError, TypeError) as err:
        raise RunError(f"{path}: not a region record (lacks {err})") from None
    if not isinstance(link.central_round, int) or isinstance(link.central_round, bool) or link.central_round < 0:
        raise RunError(f"{path}: central_round {link.central_round!r} is not a round number")
    return link


def round_examples(state: dict[str, Any]) -> int:
    """The examples of the device updates one round took: an ingested round's accepted files, an online
    round's or buffered version's replies (state.json ``ingest`` / ``replies``)."""
    if state.get("ingest") is not None:
        return sum(int(r.get("num_examples") or 0) for r in state["ingest"] if r.get("accepted"))
    return sum(int(r.get("examples") or 0) for r in state.get("replies") or [])


@dataclass
class RegionUpdate:
    """What `region_update` wrote: the file and what it sums."""

    file: Path
    region: Path
    central_run_id: str | None
    central_round: int
    rounds: list[int]
    examples: int
    mean_loss: float
    delta_norm: float

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "file": str(self.file), "region": str(self.region)}


def region_update(region: str | Path, out: str | Path) -> RegionUpdate:
    """Write the update file of the region's rounds since the central round it started from (module
    docstring). ``RunError`` (nothing written): not a region, no round since, its base round not the
    central one, the PromptFormer moved, no examples, more examples than the central bound."""
    run = RunDir(region)
    config, link = run.read_config(), read_link(run)
    base, last = link.central_round, run.last_round()
    if base not in run.rounds():
        raise RunError(f"{run.round_path(base)}: missing: the region's copy of central round {base}")
    if _sha256(run.round_weights_path(base)) != link.checkpoint_sha256:
        raise RunError(f"{run.round_weights_path(base)}: not central round {base}'s checkpoint any more "
                       f"(sha256 differs from {REGION_RECORD}): the region's base was changed")
    if last is None or last <= base:
        raise RunError(f"{run.path}: no round after round {base} (the central round it started from): nothing to send")
    latest = run.load_checkpoint(last)
    pf_base, pf_last = (promptformer_digest(_numpy(run.load_checkpoint(r).tensors, PROMPTFORMER_PREFIX))
                        for r in (base, last))
    if pf_base != link.promptformer_digest or pf_last != pf_base:
        raise RunError(f"{run.path}: round {last}'s PromptFormer is not round {base}'s: an update file carries only "
                       f"the LoRA (train the region's rounds LoRA-only: device updates, ingest, buffered edges)")
    rounds = [r for r in run.rounds() if base < r <= last]
    states = [run.round_state(r) for r in rounds]
    examples = sum(round_examples(s) for s in states)
    if examples <= 0:
        raise RunError(f"{run.path}: rounds {rounds[0]}-{last} record no device examples (state.json replies/ingest)")
    if examples > link.edge_max_examples:
        raise RunError(f"{run.path}: {examples} examples since round {base}, more than the central run's [server] "
                       f"edge_max_examples ({link.edge_max_examples}): raise it in the central preset (a region's "
                       f"update weighs all its devices' examples) and start the region again")
    losses = [((s.get("metrics") or {}).get("train_loss"), round_examples(s)) for s in states]
    losses = [(float(loss), n) for loss, n in losses  # null: not measured (fedmvp_formats.strict_json)
              if isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss) and n > 0]
    if not losses:
        raise RunError(f"{run.path}: rounds {rounds[0]}-{last} record no finite train_loss")
    mean_loss = sum(loss * n for loss, n in losses) / sum(n for _, n in losses)
    lora = _numpy(latest.tensors, LORA_PREFIX)
    start = _numpy(run.load_checkpoint(base).tensors, LORA_PREFIX)
    if set(lora) != set(start):
        raise RunError(f"{run.path}: round {last}'s LoRA names are not round {base}'s")
    norm = math.sqrt(sum(float(np.sum((lora[k].astype(np.float64) - start[k]) ** 2)) for k in lora))
    metadata = {"bundle_id": link.checkpoint_sha256, "bundle_round": base, "num_examples": examples,
                "mean_loss": mean_loss, "created": fmt.utc_now(), "promptformer_digest": link.promptformer_digest,
                "base_digest": base_digest(link.promptformer_digest, start),  # central round R's state: its copy
                **({"run_id": link.central_run_id} if link.central_run_id else {}),
                **_classes_digest(run), "region_run_id": str(config.get("run_id") or ""),
                "region_rounds": [rounds[0], last]}
    path = write_bytes(Path(out), fmt.update_bytes(lora, metadata))
    return RegionUpdate(path, run.path, link.central_run_id, base, rounds, examples, mean_loss, norm)


def _classes_digest(run: RunDir) -> dict[str, str]:
    from fedmvp.run_classes import class_set

    classes = run.class_set()
    return {} if classes is None else {"classes_digest": class_set(classes).digest}
