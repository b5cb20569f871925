"""What every preset table's fields share: help text in the field's metadata, and the type check
that a preset file and a run's recorded tables both go through (docs/architecture.md)."""

from __future__ import annotations

from dataclasses import MISSING, field
from typing import Any

from fedmvp_formats.record import is_float, type_name, type_ok  # the records' own type check (one)

__all__ = ["is_float", "spec_field", "type_name", "type_ok"]


def spec_field(text: str, default: Any = MISSING, **kw: Any) -> Any:
    """A dataclass field with its ``help`` (tests/test_presets.py: every key has one); a list default is
    copied per instance."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": text}, **kw)
    return field(default=default, metadata={"help": text}, **kw)
