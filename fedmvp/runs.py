"""Run directories: the layout, the run's record (config.json) and one checkpoint per round. All writes atomic.

``RunDir`` owns a run: it answers what the record says (the method, the preset, the federation, the
server rules, the CLIP, the seed) so no caller re-derives them, and ``FedMVP.from_run`` rebuilds the
model from those answers. Each name below is spelled once: a ``RunDir`` constant (those the device knows
too: ``fedmvp_formats.files``) or its module's (vocabulary.json, flower.log). Each JSON record is read by one
rule (``read_record``; a round's: ``RunDir.round_state``). ``fedmvp.run_metrics`` writes the rows and plot.

```
runs/<name>/
  classes.json                the federation's whole class set: names in order, phrases, styles (run_classes.py)
  config.json                 resolved preset + overrides + the preset's text and sha256 (what was run);
                              "format": "fedmvp-run/1" marks it a run (a run made before the marker has none)
  preset.toml                 the preset's text as recorded in config.json, plus base_dir (its folder);
                              a resume reads it when the original file changed (RunDir.preset_file)
  round-0003/global.safetensors   global trainable tensors (promptformer.*, lora.*)
  round-0003/state.json           round, per-client LoRA flags, schedule, seed, complete: true
                                  (a `fedmvp ingest` round adds source: ingest and its files' records)
  metrics.jsonl / metrics.csv     one line per round (losses, Local/Base/New/HM and *_sites; ingest: updates, examples)
  zero_shot.json                  the frozen CLIP's Local/Base/New/HM on the same data
  vocabulary.json                 can the backbone tell the classes apart by text (vocabulary_check.py)
  accuracy.png                    accuracy per round
  flower.log                      Flower's and Ray's driver's warnings and errors, each left-out reply
                                  (appended, never through a link: fedmvp/federated/flower_log.py)
```
A round directory counts only once its state.json says complete, and appears whole: both files
are written into a hidden temp folder that is then renamed (``atomic.atomic_dir``).
"""

from __future__ import annotations

import errno
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedmvp_formats.files import (LINK, MISSING, NOT_AN_OBJECT, ROUND_PREFIX, ROUND_STATE, ROUND_WEIGHTS, RUN_CLASSES,
                                  RUN_CONFIG, RUN_FORMAT, RUN_FORMAT_KEY, RUN_METRICS, RUN_PRESET_COPY,
                                  JsonRecordError, is_run_format, read_json_object)
from fedmvp_formats.names import PROMPTFORMER_PREFIX
from fedmvp_formats.privacy import RECORD as PRIVACY
from fedmvp_formats.privacy import PrivacyError, PrivacyRecord
from fedmvp_formats.tensors import first_nonfinite

from fedmvp import atomic
from fedmvp.presets.server import ServerRecordError, ServerSpec

if TYPE_CHECKING:  # the lazy imports below, for type checkers (torch too: a command reading a run's records
    import torch  # imports none of it, docs/architecture.md "Layers")

    from fedmvp.data.federation import Federation
    from fedmvp.model import FedMVP, FedMVPConfig
    from fedmvp.presets.schema import Preset
    from fedmvp.run_classes import RunClass

MIGRATIONS = "docs/architecture.md, Migrations"


class RunError(RuntimeError):
    """A run directory or checkpoint that cannot be used; the message names the path."""


class RecordError(RunError):
    """A run's JSON record `read_record` refused; ``problem``: one of ``fedmvp_formats.files``'s wordings."""

    def __init__(self, error: JsonRecordError) -> None:
        super().__init__(str(error))
        self.path, self.problem, self.errno = error.path, error.problem, error.errno


def read_record(path: str | os.PathLike, follow_links: bool = False) -> dict[str, Any]:
    """THE reader of a run's JSON records (config.json, state.json, zero_shot.json): the leaf's one rule
    (``read_json_object``); anything but a JSON object is a `RecordError` naming the file and the problem."""
    try:
        return read_json_object(path, follow_links)
    except JsonRecordError as err:
        raise RecordError(err) from None


def warn(message: str) -> None:
    """One warning line on stderr (the CLI's and the simulation's output stay parseable)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def nonfinite_tensor(tensors: dict[str, torch.Tensor]) -> str | None:
    """The first tensor holding NaN or inf (a NaN checkpoint trains to NaN and evaluates at chance):
    the leaf's one check (``fedmvp_formats.tensors``) on the floating-point tensors, as numpy."""
    return first_nonfinite({name: _as_numpy(value) for name, value in tensors.items() if value.is_floating_point()})


def _as_numpy(value: torch.Tensor):
    import torch

    value = value.detach().cpu()
    return (value.float() if value.dtype == torch.bfloat16 else value).numpy()  # numpy has no bfloat16


def round_dir_name(round_number: int) -> str:
    return f"{ROUND_PREFIX}{round_number:04d}"


@dataclass
class Checkpoint:
    round: int
    tensors: dict[str, torch.Tensor]
    state: dict[str, Any]


class RunDir:
    """One training run on disk: the one owner of its files' names and of their readers and writers."""

    CONFIG = RUN_CONFIG
    PRESET_COPY = RUN_PRESET_COPY
    CLASSES = RUN_CLASSES
    METRICS = RUN_METRICS
    METRICS_CSV = "metrics.csv"
    ZERO_SHOT = "zero_shot.json"
    PLOT = "accuracy.png"
    ROUND_STATE = ROUND_STATE
    ROUND_WEIGHTS = ROUND_WEIGHTS

    def __init__(self, path: str | Path):
        self.path = Path(path)

    # ---- layout --------------------------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.path / self.CONFIG

    @property
    def preset_copy_path(self) -> Path:  # the preset's recorded text (preset.toml)
        return self.path / self.PRESET_COPY

    def round_path(self, round_number: int) -> Path:
        return self.path / round_dir_name(round_number)

    def round_state_path(self, round_number: int) -> Path:
        return self.round_path(round_number) / self.ROUND_STATE

    def round_weights_path(self, round_number: int) -> Path:
        return self.round_path(round_number) / self.ROUND_WEIGHTS

    def exists(self) -> bool:
        return self.config_path.is_file()

    # ---- config --------------------------------------------------------------------------------
    def write_config(self, config: dict[str, Any]) -> None:
        """config.json, atomically, marked a run (``format``): what the device checks before it writes."""
        atomic.write_json(self.config_path, {RUN_FORMAT_KEY: RUN_FORMAT} | config | {RUN_FORMAT_KEY: RUN_FORMAT})

    def read_config(self) -> dict[str, Any]:
        """config.json (through a link, as ever). Without the marker it is a run made before the marker and
        opens as it is: the marker changed no other key, so nothing migrates. A newer or foreign one: refused."""
        try:
            config = read_record(self.config_path, follow_links=True)
        except RecordError as err:
            if err.problem == MISSING:
                raise RunError(f"{self.path}: not a fedmvp run (no {self.CONFIG})") from None
            if err.errno == errno.ENOTDIR:
                raise RunError(f"{self.path}: not a directory") from None
            raise
        if (marker := config.get(RUN_FORMAT_KEY, RUN_FORMAT)) != RUN_FORMAT:
            why = "made by a newer fedmvp" if is_run_format(marker) else "not a fedmvp run's record"
            raise RunError(f"{self.config_path}: {RUN_FORMAT_KEY} {marker!r} ({why}; this fedmvp reads {RUN_FORMAT})")
        return config

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, round_number: int, tensors: dict[str, torch.Tensor], state: dict[str, Any],
                        *, replace: bool = True) -> None:
        """Publish a round whole (an interrupted save leaves no part of it). ``replace=False``: refuse to
        overwrite a complete round (`fedmvp ingest` adds rounds, it never rewrites one)."""
        if not replace and round_number in self.rounds():
            raise RunError(f"{self.round_path(round_number)}: round {round_number} already exists")
        bad = nonfinite_tensor(tensors)
        if bad is not None:
            raise RunError(f"{self.round_weights_path(round_number)}: tensor {bad} holds NaN or "
                           f"infinite values; round {round_number} not written")
        with atomic.atomic_dir(self.round_path(round_number)) as folder:
            atomic.save_safetensors(tensors, folder / self.ROUND_WEIGHTS, {"round": str(round_number)})
            atomic.write_json(folder / self.ROUND_STATE, {**state, "round": round_number, "complete": True})

    def round_state(self, round_number: int) -> dict[str, Any]:
        """Round ``round_number``'s record (round-NNNN/state.json), THE reader of it: `read_record`'s rule."""
        return read_record(self.round_state_path(round_number))

    def rounds(self) -> list[int]:
        """Complete rounds, ascending. A state.json missing, unreadable or cut short: an unfinished round;
        a link or no JSON object: corruption, which stops the reader with one line naming it."""
        found = []
        for child in self.path.glob(f"{ROUND_PREFIX}*"):
            try:
                number = int(child.name[len(ROUND_PREFIX):])
                if self.round_state(number).get("complete"):
                    found.append(number)
            except ValueError:  # not a round folder
                continue
            except RecordError as err:
                if err.problem in (NOT_AN_OBJECT, LINK):
                    raise
        return sorted(found)

    def last_round(self) -> int | None:
        rounds = self.rounds()
        return rounds[-1] if rounds else None

    def load_checkpoint(self, round_number: int | None = None) -> Checkpoint:
        rounds = self.rounds()
        if round_number is None:
            if not rounds:
                raise RunError(f"{self.path}: no complete round yet")
            round_number = rounds[-1]
        if round_number not in rounds:
            listed = ", ".join(map(str, rounds)) or "none"
            raise RunError(f"{self.path}: round {round_number} not found (complete rounds: {listed})")
        weights = self.round_weights_path(round_number)
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(weights))
        except Exception as err:  # safetensors raises its own error types
            raise RunError(f"{weights}: corrupt checkpoint ({err.__class__.__name__}: {err})") from err
        state = self.round_state(round_number)
        bad = nonfinite_tensor(tensors)
        if bad is not None:
            raise RunError(f"{weights}: tensor {bad} holds NaN or infinite values")
        return Checkpoint(round=round_number, tensors=tensors, state=state)

    def load_weights(self, model: FedMVP, checkpoint: Checkpoint) -> None:
        """A round's tensors into a model built from the run's record (``FedMVP.from_run``): a checkpoint of
        another model, or one lacking PromptFormer tensors, is refused with one line naming its file."""
        where = self.round_weights_path(checkpoint.round)
        try:
            missing = model.load_state(checkpoint.tensors)
        except (KeyError, ValueError) as err:
            raise RunError(f"{where}: checkpoint does not fit {model.clip_info.name}: "
                           f"{str(err).strip(chr(39))}") from None
        lacking = [m for m in missing if m.startswith(PROMPTFORMER_PREFIX)]
        if lacking:
            raise RunError(f"{where}: checkpoint lacks {len(lacking)} PromptFormer tensors (first: {lacking[0]})")

    # ---- what the record says (docs/architecture.md, "Records that travel") -----------------------
    def _entry(self, config: dict[str, Any], key: str) -> Any:
        if key not in config:
            raise RunError(f"{self.config_path}: no {key} record (a run made by an older fedmvp); train it again")
        return config[key]

    @property
    def seed(self) -> int:
        """The run's seed: the random-init backbone and the initial global model are functions of it."""
        return int(self._entry(self.read_config(), "seed"))

    def clip_spec(self) -> tuple[str, str | None]:
        """The frozen CLIP as recorded: open_clip name (or registered config) and tag or weights file."""
        spec = self.read_config().get("model")
        if not isinstance(spec, dict) or not isinstance(spec.get("clip"), str):
            raise RunError(f"{self.config_path}: no model.clip entry")
        return spec["clip"], spec.get("pretrained") or None

    def method(self, checkpoint: Checkpoint | None = None) -> FedMVPConfig:
        """The method record (``FedMVPConfig``) a round's weights were trained as: the round's own state.json
        record first, else config.json's. No record: refused (a default would rebuild another model)."""
        from fedmvp.model import FedMVPConfig

        own = checkpoint.state.get("method") if checkpoint is not None else None
        record = own if own is not None else self.read_config().get("method")
        where = self.round_state_path(checkpoint.round) if own is not None else self.config_path
        if record is None:
            raise RunError(f"{where}: no method record (a run made by an older fedmvp); train it again")
        try:
            return FedMVPConfig.from_dict(record, str(where))
        except ValueError as err:
            raise RunError(str(err)) from None

    def server(self, overrides: dict[str, Any] | None = None, where: str = "run-time overrides") -> ServerSpec:
        """The server rules as recorded (config.json ``server``), with run-time ``overrides`` (None values
        keep the record's), checked by the one range check. The migration: a record that lacks keys (a
        run of an older fedmvp) gets this fedmvp's [server] defaults for exactly those keys, with one
        warning naming them (docs/architecture.md, Migrations)."""
        record = self.read_config().get("server", {})
        if isinstance(record, dict):
            missing = tuple(k for k in ServerSpec.keys() if k not in record)
            if missing:
                _warn_once(self, f"{self.config_path}: the server record lacks {', '.join(missing)} (a run of an "
                                 f"older fedmvp); using the [server] defaults for them ({MIGRATIONS})")
                record = {**ServerSpec().subset(missing), **record}
        try:
            spec = ServerSpec.from_record(record, str(self.config_path))
            return spec.with_overrides(overrides, where) if overrides else spec
        except ServerRecordError as err:
            raise RunError(str(err)) from None

    def privacy(self) -> PrivacyRecord | None:
        """The run's ``[privacy]`` settings as recorded (config.json ``privacy``); None: no differential
        privacy (a run without the table, or of a fedmvp before it existed). Out of range: refused."""
        record = self.read_config().get(PRIVACY)
        if record is None:
            return None
        try:
            return PrivacyRecord.from_record(record, str(self.config_path))
        except PrivacyError as err:
            raise RunError(str(err)) from None

    def federation_record(self) -> dict[str, Any]:
        """The federation as recorded (client count, each client's id, name, classes; evaluations)."""
        record = self._entry(self.read_config(), "federation")
        if not isinstance(record, dict) or not isinstance(record.get("clients"), list):
            raise RunError(f"{self.config_path}: the federation record is not an object with clients")
        return record

    def class_set(self) -> list[RunClass] | None:
        """The federation's whole class set as recorded (RUN/classes.json: names in the set's order, phrases,
        sentence styles); None for a run made before the record existed (its readers migrate:
        docs/architecture.md, Migrations)."""
        from fedmvp.run_classes import ClassRecordError, read_classes

        try:
            return read_classes(self.path)
        except ClassRecordError as err:
            raise RunError(str(err)) from None

    def preset_file(self, config: dict[str, Any] | None = None) -> str:
        """The preset file the run's rounds use: the run's settings are its record (config.json
        ``preset_text``), so an edit of the original after the start must not change resumed rounds.

        While the original file still holds the recorded text it is used as is (deployed clients load it
        by that path); else runs/<name>/preset.toml (the recorded text) is, with one warning line. A run
        made before the record existed uses the original as it is now, with a warning."""
        config = config if config is not None else self.read_config()
        original, text = str(config.get("preset_path", "")), config.get("preset_text")
        if not isinstance(text, str):
            _warn_once(self, f"{self.config_path}: no recorded preset text (a run of an older fedmvp); "
                             f"using {original} as it is now")
            return original
        try:
            current = Path(original).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            current = None
        if current == text:
            return original
        copy = self.preset_copy_path
        wanted = recorded_copy(text, Path(config.get("preset_dir") or Path(original).parent))
        if not copy.is_file() or copy.read_text(encoding="utf-8", errors="replace") != wanted:
            atomic.write_text(copy, wanted)
        _warn_once(self, f"{original} {'changed' if current is not None else 'is gone'} since the run started "
                         f"(sha256 {str(config.get('preset_sha256', ''))[:12]} recorded); using the recorded "
                         f"preset {copy}")
        return str(copy)

    def preset(self) -> Preset:
        """The run's ``Preset`` (``preset_file``), its data roots unchecked (a server without the data)."""
        from fedmvp.presets.schema import PresetError, load_preset

        try:
            return load_preset(self.preset_file(), check_roots=False)
        except PresetError as err:
            raise RunError(str(err)) from None

    def federation(self) -> Federation:
        """The run's ``Federation`` from its preset and data (the process's one, ``load_federation``)."""
        from fedmvp.data.federation import load_federation

        path = self.preset_file()
        try:
            return load_federation(path)[1]
        except Exception as err:  # noqa: BLE001 - a PresetError, a missing data root, ...: one line naming it
            raise RunError(f"{path}: cannot rebuild the run's data ({str(err).splitlines()[0]})") from None

    # ---- zero-shot ---------------------------------------------------------------------------------
    def read_zero_shot(self) -> dict[str, Any] | None:
        """The frozen CLIP's metrics on the run's data (zero_shot.json); None: not measured yet."""
        try:
            return read_record(self.path / self.ZERO_SHOT)
        except RecordError as err:
            if err.problem == MISSING:
                return None
            raise

    def write_zero_shot(self, metrics: dict[str, Any]) -> None:
        atomic.write_json(self.path / self.ZERO_SHOT, metrics)


def recorded_copy(text: str, folder: Path) -> str:
    """The run's preset.toml: the preset's text with ``base_dir`` set to its folder, so relative roots
    resolve as they did (a top-level key first in a TOML file stays top-level)."""
    import tomllib

    if "base_dir" in tomllib.loads(text):
        return text
    return f"base_dir = {json.dumps(str(folder))}  # added by fedmvp: the preset's folder\n{text}"


_WARNED: set[tuple[str, str]] = set()


def _warn_once(run: RunDir, message: str) -> None:
    """A resume, the ServerApp and evaluation all ask the record in one process: say it once."""
    if (str(run.path), message) not in _WARNED:
        _WARNED.add((str(run.path), message))
        warn(message)
