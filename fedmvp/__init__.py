"""fedmvp: FedMVP federated multimodal visual prompt tuning for CLIP (training core).

The public API is ``__all__``. Each name is imported on first use (PEP 562 ``__getattr__``) so that
``import fedmvp`` stays cheap: the CLI and the device tooling read ``__version__`` without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedmvp_formats.lazy import lazy_exports

__version__ = "0.1.0"

if TYPE_CHECKING:  # what type checkers (and the import-graph test) see; at run time see __getattr__
    from fedmvp.clip import ClipLoadError, LoadedClip, load_clip
    from fedmvp.federated.prepare import prepare_run
    from fedmvp.model import FedMVP, FedMVPConfig
    from fedmvp.presets.schema import Preset, load_preset
    from fedmvp.promptformer import PromptFormer, PromptFormerConfig
    from fedmvp.runs import Checkpoint, RunDir, RunError

_HOMES = {
    "FedMVP": "fedmvp.model", "FedMVPConfig": "fedmvp.model",
    "PromptFormer": "fedmvp.promptformer", "PromptFormerConfig": "fedmvp.promptformer",
    "load_clip": "fedmvp.clip", "LoadedClip": "fedmvp.clip", "ClipLoadError": "fedmvp.clip",
    "RunDir": "fedmvp.runs", "RunError": "fedmvp.runs", "Checkpoint": "fedmvp.runs",
    "load_preset": "fedmvp.presets.schema", "Preset": "fedmvp.presets.schema",
    "prepare_run": "fedmvp.federated.prepare",
}
__all__ = list(_HOMES)


__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
