"""The method record: the hyper-parameters that shape the model, one definition for every reader.

Why here: the record travels with the weights (a run's config.json and every round's state.json,
each round's Flower message, the bundle's manifest.json; docs/architecture.md "Records that
travel"), and the training core, the exporter, the device and the preset schema all read it.
Each field is declared once below with its type, default, allowed range and help text (the record
base, ``fedmvp_formats.record``);
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

from collections.abc import Callable
from dataclasses import Field, dataclass
from typing import Any, TypeVar

from fedmvp_formats.record import UNVERSIONED, VERSION_KEY, Bound, Names, Record, record_field

__all__ = ["LORA_LAYERS", "STEPS", "UNVERSIONED", "VERSION", "VERSION_KEY", "MethodError", "MethodRecord",
           "field_problem", "method_field", "method_fields"]

VERSION = 1  # the record this release writes
# The PromptFormer's Linear layers (fedmvp/promptformer.py): where peft may put LoRA. The exporter's
# edge graph carries it on to_q/to_k/to_v only and refuses the others itself (export/edge_module.py).
LORA_LAYERS = ("to_q", "to_k", "to_v", "to_out", "proj_in", "proj_out", "text_proj")
# version N -> N + 1 beyond filling added fields (a rename, a changed unit); none so far.
STEPS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}


R = TypeVar("R", bound="MethodRecord")


class MethodError(ValueError):
    """A method record that cannot be used; one line naming its source and the problem."""


@dataclass
class MethodRecord(Record):
    """Method hyper-parameters (the paper's defaults, docs/method.md §2-§5)."""

    ERROR = MethodError
    NAME = "method record"
    PREFIX = "method record: "
    RANGES_SEE_WRITTEN = True
    steps = STEPS

    num_prompts: int = record_field(4, "prompt tokens pooled from the PromptFormer output and appended per "
                                       "image (m)", Bound(1))
    heads: int = record_field(4, "attention heads in the PromptFormer", Bound(1))
    ff_mult: int = record_field(4, "GEGLU inner width = ff_mult * vision width", Bound(1))
    alpha: float = record_field(10.0, "weight of the consistency loss L_con (0 disables it)", Bound(0.0))
    flip_prob: float = record_field(0.5, "per-sample horizontal flip probability of the consistency view",
                                    Bound(0.0, 1.0))
    lora_rank: int = record_field(8, "LoRA rank on the PromptFormer's cross-attention projections", Bound(1))
    lora_targets: tuple[str, ...] = record_field(("to_q", "to_k", "to_v"), "PromptFormer Linear layers that "
                                                 "get LoRA", Names(LORA_LAYERS, "layer"))
    use_lora: bool = record_field(True, "allow the switch to LoRA-only training (false: the 'w/o LoRA' ablation)")

    def __post_init__(self) -> None:
        self.lora_targets = tuple(self.lora_targets)

    @classmethod
    def current_version(cls) -> int:
        return VERSION  # the module's, read at each call: a test stands in a later release by setting it

    def to_dict(self) -> dict[str, Any]:
        """The record that travels with the weights, with its ``version`` (JSON types: lists, not tuples)."""
        return self.record()

    @classmethod
    def from_dict(cls: type[R], record: Any, where: str = "method") -> R:
        """The record as written (migrated to this version), every field checked; ``MethodError`` (a
        ``ValueError``) names ``where`` and the problem in one line (``Record.from_record``)."""
        return cls.from_record(record, where)


def method_fields() -> tuple[Field, ...]:
    """The record's fields in order (name, default, ``metadata``: help, checks, since)."""
    return MethodRecord.record_fields()


def method_field(name: str) -> Field:
    """One field of the record by name (KeyError: not a method field)."""
    return MethodRecord.field_named(name)


def field_problem(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be the field ``name`` ("lora_rank must be at least 1, got 0"); None if it can."""
    return MethodRecord.field_problem(name, value)
