"""The method record: the hyper-parameters that shape the model, one definition for every reader.

Why here: the record travels with the weights (a run's config.json and every round's state.json,
each round's Flower message, the bundle's manifest.json; docs/architecture.md "Records that
travel"), and the training core, the exporter, the device and the preset schema all read it.
Each field is declared once below with its type, default, allowed range and help text;
``fedmvp.model.FedMVPConfig`` is this record, ``edge_client.bundle`` reads a manifest's ``method``
through it, and the preset's ``[train]`` keys that become the method take their defaults, ranges
and help from it (``fedmvp.presets.schema``).

Versions: the record carries ``version`` (``VERSION``). A record without one was written before
the version existed (every run and bundle made until then) and is version 1. ``migrate`` brings
an older record to the current version: a field added in version N (``since=N``) is filled with
its documented default, which must be what the code did before the field existed, so adding a
field orphans no run or bundle. A field of the record's own version that is missing stays an
error: filling it from a default would build another model than the weights were trained as.
A newer version than this release knows is refused with one line (update fedmvp).
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from dataclasses import Field, asdict, dataclass, field, fields
from typing import Any, TypeVar

VERSION = 1  # the record this release writes
UNVERSIONED = 1  # what a record without ``version`` is: the layout every release before the version wrote
VERSION_KEY = "version"
# The PromptFormer's Linear layers (fedmvp/promptformer.py): where peft may put LoRA. The exporter's
# edge graph carries it on to_q/to_k/to_v only and refuses the others itself (export/edge_module.py).
LORA_LAYERS = ("to_q", "to_k", "to_v", "to_out", "proj_in", "proj_out", "text_proj")


R = TypeVar("R", bound="MethodRecord")


class MethodError(ValueError):
    """A method record that cannot be used; one line naming its source and the problem."""


def _field(default: Any, help: str, *, low: float | None = None, high: float | None = None,
           choices: tuple[str, ...] | None = None, since: int = 1) -> Any:
    """A record field: its default, help and range (``low``/``high`` inclusive, ``choices`` for names),
    and ``since``, the record version that added it (docs: the module's "Versions")."""
    meta = {"help": help, "low": low, "high": high, "choices": choices, "since": since}
    return field(default=default, metadata=meta)


@dataclass
class MethodRecord:
    """Method hyper-parameters (the paper's defaults, docs/method.md §2-§5)."""

    num_prompts: int = _field(4, "prompt tokens pooled from the PromptFormer output and appended per image (m)",
                              low=1)
    heads: int = _field(4, "attention heads in the PromptFormer", low=1)
    ff_mult: int = _field(4, "GEGLU inner width = ff_mult * vision width", low=1)
    alpha: float = _field(10.0, "weight of the consistency loss L_con (0 disables it)", low=0.0)
    flip_prob: float = _field(0.5, "per-sample horizontal flip probability of the consistency view",
                              low=0.0, high=1.0)
    lora_rank: int = _field(8, "LoRA rank on the PromptFormer's cross-attention projections", low=1)
    lora_targets: tuple[str, ...] = _field(("to_q", "to_k", "to_v"), "PromptFormer Linear layers that get LoRA",
                                           choices=LORA_LAYERS)
    use_lora: bool = _field(True, "allow the switch to LoRA-only training (false: the 'w/o LoRA' ablation)")

    def __post_init__(self) -> None:
        self.lora_targets = tuple(self.lora_targets)

    def to_dict(self) -> dict[str, Any]:
        """The record that travels with the weights, with its ``version`` (JSON types: lists, not tuples)."""
        return {**asdict(self), "lora_targets": list(self.lora_targets), VERSION_KEY: VERSION}

    @classmethod
    def from_dict(cls: type[R], record: Any, where: str = "method") -> R:
        """The record as written (migrated to this version), every field checked; ``MethodError`` (a
        ``ValueError``) names ``where`` and the problem in one line.

        Why strict: a reader that filled a missing key from the defaults would silently build another
        model than the one the weights were trained as (only ``migrate`` fills, and only later fields)."""
        values = check_record(migrate(record, where), where)
        return cls(**values)


def method_fields() -> tuple[Field, ...]:
    """The record's fields in order (name, default, ``metadata``: help, low, high, choices, since)."""
    return fields(MethodRecord)


def method_field(name: str) -> Field:
    """One field of the record by name (KeyError: not a method field)."""
    for f in fields(MethodRecord):
        if f.name == name:
            return f
    raise KeyError(name)


def _hints() -> dict[str, Any]:
    return typing.get_type_hints(MethodRecord)


def field_problem(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be the field ``name`` ("lora_rank must be at least 1, got 0"); None if it can."""
    f, hint = method_field(name), _hints()[name]
    meta = f.metadata
    if hint is bool:
        return None if isinstance(value, bool) else f"{name} must be true or false, got {value!r}"
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        return f"{name} must be an integer, got {value!r}"
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{name} must be a number, got {value!r}"
        if not math.isfinite(value):
            return f"{name} must be a finite number, got {value!r}"
    if hint in (int, float):
        low, high = meta["low"], meta["high"]
        if low is not None and high is not None and not low <= value <= high:
            return f"{name} must be in [{low}, {high}], got {value!r}"
        if low is not None and value < low:
            what = "at least 1" if (hint is int and low == 1) else f"{low} or more"
            return f"{name} must be {what}, got {value!r}"
        return None
    # tuple[str, ...]: a list of names (JSON has no tuples), at least one, each once, each a choice
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) for v in value):
        return f"{name} must be a non-empty list of names, got {value!r}"
    unknown = [v for v in value if meta["choices"] and v not in meta["choices"]]
    if unknown:
        return f"{name}: unknown layer {unknown[0]!r} (one of {', '.join(meta['choices'])})"
    if len(set(value)) != len(value):
        return f"{name} names a layer twice, got {list(value)!r}"
    return None


def check_record(record: dict[str, Any], where: str) -> dict[str, Any]:
    """The record's field values (without ``version``), every field present, known and in range."""
    names = [f.name for f in fields(MethodRecord)]
    unknown = sorted(set(record) - set(names) - {VERSION_KEY})
    missing = [n for n in names if n not in record]
    if unknown or missing:
        detail = "; ".join(filter(None, [f"missing {', '.join(missing)}" if missing else "",
                                         f"unknown {', '.join(unknown)}" if unknown else ""]))
        raise MethodError(f"{where}: method record does not match this fedmvp ({detail})")
    for name in names:
        problem = field_problem(name, record[name])
        if problem:
            raise MethodError(f"{where}: method record: {problem}")
    hints = _hints()
    values = {n: float(record[n]) if hints[n] is float else record[n] for n in names}
    values["lora_targets"] = tuple(values["lora_targets"])
    return values


# version N -> N + 1 beyond filling added fields (a rename, a changed unit); none so far.
STEPS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}


def record_version(record: dict[str, Any], where: str) -> int:
    """The record's version (``UNVERSIONED`` without one); a newer or malformed one is refused."""
    version = record.get(VERSION_KEY, UNVERSIONED)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise MethodError(f"{where}: method record version {version!r} is not a version (a positive integer)")
    if version > VERSION:
        raise MethodError(f"{where}: method record version {version} is newer than this fedmvp reads "
                          f"(up to {VERSION}); update fedmvp")
    return version


def migrate(record: Any, where: str = "method") -> dict[str, Any]:
    """``record`` brought to ``VERSION``: each step of ``STEPS`` in turn, and every field added after the
    record's version filled with its documented default (docs: the module's "Versions")."""
    if not isinstance(record, dict):
        raise MethodError(f"{where}: not a method record (got {type(record).__name__})")
    version = record_version(record, where)
    out = dict(record)
    for step in range(version, VERSION):
        out = STEPS.get(step, dict)(out)
    for f in fields(MethodRecord):
        if f.metadata["since"] > version and f.name not in out:
            out[f.name] = list(f.default) if isinstance(f.default, tuple) else f.default
    out[VERSION_KEY] = VERSION
    return out
