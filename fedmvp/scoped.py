"""Process-wide settings changed for the length of a ``with`` block only, then put back exactly as
they were: an environment variable that was unset is unset again, an attribute that was absent is
deleted again, also when the block raises.

Why: the library runs inside other programs (a test session, a notebook, a Flower node); a change
it makes to ``os.environ`` or to another package's module must not outlive the call that needed it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Mapping

_ABSENT = object()


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set inside the block; each key restored (or removed) after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def attribute(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` set to ``value`` inside the block; the old value (or its absence) restored after."""
    saved = owner.__dict__.get(name, _ABSENT) if hasattr(owner, "__dict__") else getattr(owner, name, _ABSENT)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if saved is _ABSENT:
            with contextlib.suppress(AttributeError):
                delattr(owner, name)
        else:
            setattr(owner, name, saved)
