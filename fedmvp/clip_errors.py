"""The backbone's one error, apart from `fedmvp.clip`: a command catches it without importing open_clip
and torch (5 CPU-seconds a process; `fedmvp join` of a [[datasets]] site never loads CLIP itself)."""

from __future__ import annotations


class ClipLoadError(RuntimeError):
    """The backbone could not be built or its weights could not be found offline."""
