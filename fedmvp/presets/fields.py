"""What every preset table's fields share: help text in the field's metadata, and the type check
that a preset file and a run's recorded tables both go through (docs/architecture.md)."""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, field
from typing import Any


def spec_field(text: str, default: Any = MISSING, **kw: Any) -> Any:
    """A dataclass field with its ``help`` (tests/test_presets.py: every key has one); a list default is
    copied per instance."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": text}, **kw)
    return field(default=default, metadata={"help": text}, **kw)


def type_ok(value: Any, hint: Any) -> bool:
    """``value`` fits the field's type: no bool for a number, an int for a float, lists element-wise."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(type_ok(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(type_ok(v, args[0]) for v in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def type_name(hint: Any) -> str:
    """The type as an error line says it ("an integer", "a number (optional)")."""
    if isinstance(hint, type):
        return {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false"}.get(
            hint.__name__, hint.__name__)
    return str(hint).replace("typing.", "").replace("NoneType", "none").replace(" | none", " (optional)")


def is_float(hint: Any) -> bool:
    """A float field, plain or optional (its int values are stored as floats)."""
    return hint is float or typing.get_args(hint) == (float, type(None))
