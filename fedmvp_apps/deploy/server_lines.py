"""What a server operator reads of each round: one line per round, as its checkpoint appears.

`fedmvp serve` without a terminal (a log file, a systemd unit) prints, for every round the ServerApp
writes (docs/tutorials/across-machines.md, "What the server prints"):

    round 2/3: replied 2 (north-ward, south-ward), left out 0, timed out 0; loss 1.2345; Local 50.00, Base 66.67, New 33.33, HM 44.44; 3.1 s

who replied (a site by its name, ``site N`` where sites have none, ``edge node N``), whose reply was
left out and a short reason (the whole reason is the line printed as it happened, and state.json's
``rejected``), who was sent the round and never replied (state.json ``timed_out``), the round's mean
training loss, the paper's figures when the round was evaluated, and its seconds from sending to
aggregation. Everything comes from the round's state.json alone (`RoundWatch` reads each new one:
the ServerApp runs in a process of its own); ``round_record`` is also each entry of `fedmvp serve
--json`'s ``round_log``. A node's site name reaches the line through `name_shown` (an open
federation's sites name themselves).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fedmvp_formats.shown import name_shown

FIGURES = (("local", "Local"), ("base", "Base"), ("new", "New"), ("hm", "HM"), ("domain", "Domain"))
LISTED = 4  # names a part of the line lists; the rest as "+N more"
REASON = 60  # characters of a left-out reason on the line


def who(entry: dict) -> str:
    """A reply's or a left-out reply's sender, short: its site's name, ``site N``, ``edge node N``."""
    if entry.get("role") == "edge":
        return f"edge node {entry.get('node')}"
    if entry.get("name") is not None:
        return name_shown(str(entry["name"]))
    if entry.get("site") is not None:
        return f"site {entry['site']}"
    return f"node {entry.get('node')}"


def round_record(state: dict) -> dict[str, Any]:
    """One round as the operator reads it, from its state.json: ``round``, ``total_rounds``, ``replied``,
    ``left_out`` (who, reason), ``timed_out``, ``late`` (only where devices were discarded as late),
    ``train_loss``, ``evaluation`` (None: not evaluated),
    ``seconds`` (None: a round written before they were recorded, or by `fedmvp ingest`)."""
    metrics = state.get("metrics") or {}
    record = {"round": state.get("round"), "total_rounds": state.get("total_rounds"),
              "replied": [who(r) for r in state.get("replies") or []],
              "left_out": [{"who": who(e), "reason": str(e.get("reason", ""))} for e in state.get("rejected") or []],
              "timed_out": [str(name) for name in state.get("timed_out") or []],
              "train_loss": metrics.get("train_loss"), "seconds": state.get("seconds"),
              "evaluation": {key: metrics.get(key) for key, _ in FIGURES if key in metrics} if "hm" in metrics else None}
    if state.get("late"):  # an over-selected round's devices discarded as late (fedmvp/federated/dropouts.py)
        record["late"] = [str(name) for name in state["late"]]
    if state.get("source") == "ingest":  # a round of update files, not of replies (fedmvp/federated/ingest.py)
        files = state.get("ingest") or []
        record["ingested"] = [sum(bool(f.get("accepted")) for f in files), len(files)]
    return record


def _names(names: list[str]) -> str:
    more = f", +{len(names) - LISTED} more" if len(names) > LISTED else ""
    return f" ({', '.join(names[:LISTED])}{more})" if names else ""


def _reason(reason: str) -> str:
    return reason if len(reason) <= REASON else reason[:REASON - 3] + "..."


def _percent(value: Any) -> str:
    return f"{100 * value:.2f}" if isinstance(value, (int, float)) and math.isfinite(value) else "-"


def round_line(record: dict) -> str:
    """``round_record``'s one line (module docstring)."""
    total = record.get("total_rounds")
    parts = [f"round {record.get('round')}" + (f"/{total}" if total else "") + ":"]
    if "ingested" in record:
        parts.append(f"ingested {record['ingested'][0]} of {record['ingested'][1]} update files")
    else:
        left = [f"{e['who']}: {_reason(e['reason'])}" for e in record["left_out"]]
        parts.append(f"replied {len(record['replied'])}{_names(record['replied'])}, left out {len(left)}"
                     f"{_names(left)}, timed out {len(record['timed_out'])}{_names(record['timed_out'])}"
                     + (f", late {len(record['late'])}{_names(record['late'])}" if record.get("late") else ""))
    line = " ".join(parts)
    loss = record.get("train_loss")
    if isinstance(loss, (int, float)):
        line += f"; loss {loss:.4f}"
    evaluation = record.get("evaluation")
    if evaluation is not None:
        line += "; " + ", ".join(f"{label} {_percent(evaluation.get(key))}" for key, label in FIGURES
                                 if key in evaluation and (key != "domain" or evaluation[key] is not None))
    seconds = record.get("seconds")
    return line + (f"; {seconds:.1f} s" if isinstance(seconds, (int, float)) else "")


class RoundWatch:
    """The rounds of a run directory not seen yet, each as its state.json says (complete rounds only:
    a round directory appears whole, fedmvp/runs.py)."""

    def __init__(self, run_dir: Path, after: int | None = None):
        """``after``: the last round already seen (default: the run's last complete round now, so a
        resumed run's earlier rounds are not told again)."""
        from fedmvp.runs import RunDir, RunError

        self.run = RunDir(run_dir)
        try:
            self.seen = (self.run.last_round() or 0) if after is None else after
        except RunError:  # a round's record that is no JSON object: the ServerApp refuses the run in one line
            self.seen = 0

    def new(self) -> list[dict]:
        """The ``round_record`` of every complete round after the last one returned, in order. A record that
        cannot be read is passed over: the ServerApp, which reads its rounds too, says what is wrong."""
        from fedmvp.runs import RunError

        records = []
        try:
            numbers = [n for n in self.run.rounds() if n > self.seen]
        except RunError:
            return []
        for number in numbers:
            try:
                state = json.loads((self.run.round_path(number) / "state.json").read_text())
                records.append(round_record({"round": number, **state}))
            except (OSError, ValueError, TypeError, AttributeError):
                pass
            self.seen = number
        return records
