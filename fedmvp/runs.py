"""Run directories: resolved config, one checkpoint per round, metrics, a plot. All writes atomic.

```
runs/<name>/
  config.json                 resolved preset + overrides + the preset's text and sha256 (what was run)
  preset.toml                 the preset's text as recorded in config.json, plus base_dir (its folder);
                              a resume reads it when the original file changed (prepare.run_preset)
  round-0003/global.safetensors   global trainable tensors (promptformer.*, lora.*)
  round-0003/state.json           round, per-client LoRA flags, schedule, seed, complete: true
                                  (a `fedmvp ingest` round adds source: ingest and its files' records)
  metrics.jsonl / metrics.csv     one line per round (losses, Local/Base/New/HM; ingest: updates, examples)
  zero_shot.json                  the frozen CLIP's Local/Base/New/HM on the same data
  accuracy.png                    accuracy per round
```
A round directory counts only once its state.json says complete, and appears whole: both files
are written into a hidden temp folder that is then renamed (``atomic.atomic_dir``).
"""

from __future__ import annotations

import csv
import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from fedmvp_formats.tensors import first_nonfinite

from fedmvp import atomic

ROUND_PREFIX = "round-"
METRIC_COLUMNS = ["round", "train_loss", "train_ce", "train_consistency", "lora_clients", "clients",
                  "local", "base", "new", "hm", "domain", "edges", "edge_acc", "source", "updates", "examples"]


class RunError(RuntimeError):
    """A run directory or checkpoint that cannot be used; the message names the path."""


def warn(message: str) -> None:
    """One warning line on stderr (the CLI's and the simulation's output stay parseable)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def nonfinite_tensor(tensors: dict[str, torch.Tensor]) -> str | None:
    """The first tensor holding NaN or inf (a NaN checkpoint trains to NaN and evaluates at chance):
    the leaf's one check (``fedmvp_formats.tensors``) on the floating-point tensors, as numpy."""
    return first_nonfinite({name: _as_numpy(value) for name, value in tensors.items() if value.is_floating_point()})


def _as_numpy(value: torch.Tensor):
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
    """One training run on disk."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    # ---- layout --------------------------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.path / "config.json"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    def round_path(self, round_number: int) -> Path:
        return self.path / round_dir_name(round_number)

    def exists(self) -> bool:
        return self.config_path.is_file()

    # ---- config --------------------------------------------------------------------------------
    def write_config(self, config: dict[str, Any]) -> None:
        atomic.write_json(self.config_path, config)

    def read_config(self) -> dict[str, Any]:
        try:
            config = json.loads(self.config_path.read_text())
        except FileNotFoundError as err:
            raise RunError(f"{self.path}: not a fedmvp run (no config.json)") from err
        except NotADirectoryError as err:
            raise RunError(f"{self.path}: not a directory") from err
        except IsADirectoryError as err:
            raise RunError(f"{self.config_path}: a directory, not a file") from err
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RunError(f"{self.config_path}: corrupt JSON ({err})") from err
        if not isinstance(config, dict):
            raise RunError(f"{self.config_path}: not a JSON object (got {type(config).__name__})")
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
            raise RunError(f"{self.round_path(round_number) / 'global.safetensors'}: tensor {bad} holds NaN or "
                           f"infinite values; round {round_number} not written")
        with atomic.atomic_dir(self.round_path(round_number)) as folder:
            atomic.save_safetensors(tensors, folder / "global.safetensors", {"round": str(round_number)})
            atomic.write_json(folder / "state.json", {**state, "round": round_number, "complete": True})

    def rounds(self) -> list[int]:
        """Complete rounds, ascending. A state.json that parses but is no JSON object is corruption,
        not an unfinished round: it stops the reader with one line naming it."""
        found = []
        for child in self.path.glob(f"{ROUND_PREFIX}*"):
            state = child / "state.json"
            try:
                number = int(child.name[len(ROUND_PREFIX):])
                record = json.loads(state.read_text()) if state.is_file() else {}
            except (ValueError, OSError):  # not a round folder, or a state.json cut short (JSON errors)
                continue
            if not isinstance(record, dict):
                raise RunError(f"{state}: not a JSON object (got {type(record).__name__}); move {child} aside")
            if record.get("complete"):
                found.append(number)
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
        folder = self.round_path(round_number)
        weights = folder / "global.safetensors"
        try:
            tensors = load_file(str(weights))
            state = json.loads((folder / "state.json").read_text())
        except Exception as err:  # safetensors raises its own error types
            raise RunError(f"{weights}: corrupt checkpoint ({err.__class__.__name__}: {err})") from err
        bad = nonfinite_tensor(tensors)
        if bad is not None:
            raise RunError(f"{weights}: tensor {bad} holds NaN or infinite values")
        return Checkpoint(round=round_number, tensors=tensors, state=state)

    # ---- metrics -------------------------------------------------------------------------------
    def read_metrics(self) -> list[dict[str, Any]]:
        """Rows of metrics.jsonl; a line that is no JSON object (e.g. cut short by a full disk) is dropped
        with a warning: the rounds' own state.json records hold the same rows (``rebuild_metrics``)."""
        if not self.metrics_path.is_file():
            return []
        rows = []
        for number, line in enumerate(self.metrics_path.read_text(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not isinstance(row, dict):
                warn(f"{self.metrics_path}: line {number} is not a JSON object (cut short?); dropped")
                continue
            rows.append(row)
        return rows

    def append_metrics(self, row: dict[str, Any]) -> None:
        """Rewrite metrics.jsonl/csv atomically with ``row`` (replacing an older row of the same round)."""
        rows = [r for r in self.read_metrics() if r.get("round") != row.get("round")] + [row]
        rows.sort(key=lambda r: r.get("round", 0))
        atomic.write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in rows))
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=METRIC_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        atomic.write_text(self.path / "metrics.csv", buffer.getvalue())

    def truncate_metrics_after(self, round_number: int) -> None:
        """On resume, forget metrics of rounds that never completed; rows missing from metrics.jsonl (a
        line cut short) come back from their round's state.json."""
        kept = {r.get("round"): r for r in self.read_metrics() if r.get("round", 0) <= round_number}
        for number in self.rounds():
            if number <= round_number and number not in kept:
                try:
                    row = json.loads((self.round_path(number) / "state.json").read_text()).get("metrics")
                except (OSError, ValueError):
                    row = None
                if isinstance(row, dict):
                    kept[number] = row
        rows = [kept[k] for k in sorted(kept, key=lambda k: k or 0)]
        atomic.write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in rows))

    def plot(self) -> Path | None:
        """accuracy.png: Local/Base/New/HM per evaluated round, zero-shot as dashed lines."""
        rows = [r for r in self.read_metrics() if r.get("hm") is not None]
        if not rows:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        zero_shot = self.read_json("zero_shot.json") or {}
        fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
        for key, colour in (("local", "C0"), ("base", "C1"), ("new", "C2"), ("hm", "C3"), ("domain", "C4")):
            points = [(r["round"], 100 * r[key]) for r in rows if r.get(key) is not None]
            if not points:  # e.g. no new classes (domain protocols), no held-out domain
                continue
            ax.plot(*zip(*points), marker="o", color=colour, label=key.capitalize() if key != "hm" else "HM")
            if zero_shot.get(key) is not None:
                ax.axhline(100 * zero_shot[key], color=colour, linestyle="--", linewidth=0.8)
        ax.set_xlabel("round")
        ax.set_ylabel("top-1 accuracy (%)")
        ax.set_title(f"{self.path.name} (dashed: zero-shot)")
        ax.legend(loc="lower right")
        ax.grid(alpha=0.3)
        target = self.path / "accuracy.png"
        with atomic.atomic_path(target) as tmp:
            fig.savefig(tmp, format="png", bbox_inches="tight")
        plt.close(fig)
        return target

    def read_json(self, name: str) -> dict[str, Any] | None:
        path = self.path / name
        return json.loads(path.read_text()) if path.is_file() else None

    def write_json(self, name: str, obj: dict[str, Any]) -> None:
        atomic.write_json(self.path / name, obj)
