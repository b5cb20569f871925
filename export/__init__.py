"""fedmvp-export: turns a federated round checkpoint into an edge bundle (ONNX + training artifact).

The public API is ``__all__``, imported on first use (PEP 562 ``__getattr__``): the exporter pulls
torch, open_clip and ONNX, which ``import export`` alone should not pay for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedmvp_formats.lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers (and the import-graph test) see; at run time see __getattr__
    from export.bundle_writer import (BundleInputs, BundleOptions, BundleResult, ExportOptions, ParityError,
                                      export_bundle, write_bundle)
    from export.errors import ExportError

_HOMES = {
    "export_bundle": "export.bundle_writer", "write_bundle": "export.bundle_writer",
    "BundleResult": "export.bundle_writer", "ParityError": "export.bundle_writer",
    "ExportOptions": "export.bundle_writer", "BundleOptions": "export.bundle_writer",
    "BundleInputs": "export.bundle_writer",
    "ExportError": "export.errors",
}
__all__ = list(_HOMES)


__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
