"""JSON the project writes parses with any strict parser: no ``NaN`` or ``Infinity`` token, ever.

Python's ``json`` writes ``NaN`` and ``Infinity`` by default, which JSON does not have: ``jq``, browsers and
most languages' parsers refuse the file (a buffered version's ``train_ce``, measured by no device, was
written as ``NaN``). A number that is not finite means "not measured" where it is ours (a part of a loss
nobody reported), and is refused where a sender wrote it (``fedmvp_formats.bounds``); written, it is
``null``. ``dumps`` is what every writer of a record, a manifest or a command's ``--json`` uses.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite_or_null(value: Any) -> Any:
    """``value`` with every float that is not finite (numpy's too) replaced by None, in dicts, lists and tuples."""
    if isinstance(value, float) or (hasattr(value, "dtype") and getattr(value, "shape", None) == ()
                                    and getattr(value.dtype, "kind", "") == "f"):
        number = float(value)
        return number if math.isfinite(number) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(item) for item in value]
    return value


def dumps(value: Any, **options: Any) -> str:
    """``json.dumps`` of `finite_or_null` (``value``), refusing any non-finite number left (``allow_nan=False``)."""
    return json.dumps(finite_or_null(value), allow_nan=False, **options)


def loads(text: str | bytes) -> Any:
    """``json.loads`` that refuses ``NaN``, ``Infinity`` and ``-Infinity`` (ValueError), as a strict parser does."""
    def refuse(token: str) -> Any:
        raise ValueError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)
