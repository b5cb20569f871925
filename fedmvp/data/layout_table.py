"""The one table of dataset layouts: a preset's ``layout`` name -> its `Layout` (``layout_base.py``).

Why one table: the preset's check, the planner and the builder all ask ``layout_of(spec.layout)``, so a
new layout is its module and one line here, or ``register_layout(name, layout)`` from outside the
package before the preset is loaded (docs/architecture.md, "How to add ...").
"""

from __future__ import annotations

from fedmvp.data.builtin_layouts import CoopLayout, DomainBedLayout, ImageFolderLayout, SyntheticLayout
from fedmvp.data.layout_base import Layout

_LAYOUTS: dict[str, Layout] = {
    "imagefolder": ImageFolderLayout(),
    "coop": CoopLayout(),
    "domainbed": DomainBedLayout(),
    "synthetic": SyntheticLayout(),
}


def register_layout(name: str, layout: Layout, replace: bool = False) -> None:
    """Make ``layout`` the one a preset's ``layout = "name"`` reads; a taken name needs ``replace``."""
    if not isinstance(layout, Layout):
        raise TypeError(f"layout {name!r} must be a fedmvp.data.layout_base.Layout, got {type(layout).__name__}")
    if not name or name != name.strip():
        raise ValueError(f"a layout name must be a non-empty word, got {name!r}")
    if name in _LAYOUTS and not replace:
        raise ValueError(f"layout {name!r} is registered already (replace=True to replace it)")
    _LAYOUTS[name] = layout


def unregister_layout(name: str) -> None:
    """Remove a layout ``register_layout`` added (a test's, when it ends)."""
    _LAYOUTS.pop(name, None)


def layout_names() -> tuple[str, ...]:
    """The registered layouts, in registration order (a preset's error line names them)."""
    return tuple(_LAYOUTS)


def find_layout(name: str) -> Layout | None:
    """The layout registered as ``name``, or None."""
    return _LAYOUTS.get(name)


def layout_of(name: str) -> Layout:
    """The layout registered as ``name``; an unknown one is a ValueError naming the registered ones (a
    loaded preset's layout is always registered: the schema checked it)."""
    layout = _LAYOUTS.get(name)
    if layout is None:
        raise ValueError(f"unknown layout {name!r} (one of {', '.join(_LAYOUTS)})")
    return layout
