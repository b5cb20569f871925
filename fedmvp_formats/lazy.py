"""A package's public API imported on first use (PEP 562), shared by the three packages' ``__init__``.

``import edge_client`` must load neither ONNX Runtime nor torch, and ``import fedmvp`` / ``import
export`` should not pay for torch and open_clip until a name is used; each ``__init__`` lists where
its public names live and takes its ``__getattr__`` / ``__dir__`` from here.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, homes: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: a public name's module is imported on first use and
    the name kept in the package's namespace, so later lookups skip this."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *homes})

    return __getattr__, __dir__
