"""fedmvp-export: turns a federated round checkpoint into an edge bundle (ONNX + training artifact).

The public API is ``__all__``, imported on first use (PEP 562 ``__getattr__``): the exporter pulls
torch, open_clip and ONNX, which ``import export`` alone should not pay for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers (and the import-graph test) see; at run time see __getattr__
    from export.bundle_writer import BundleResult, ParityError, export_bundle, write_bundle
    from export.errors import ExportError

_HOMES = {
    "export_bundle": "export.bundle_writer", "write_bundle": "export.bundle_writer",
    "BundleResult": "export.bundle_writer", "ParityError": "export.bundle_writer",
    "ExportError": "export.errors",
}
__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use and keep the name (later lookups skip this)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
