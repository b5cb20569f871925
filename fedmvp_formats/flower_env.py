"""The environment every Flower process of ours runs under: quiet and offline.

One definition for the simulation (`fedmvp train`, docs/architecture.md), the SuperLink
(`fedmvp serve`) and both SuperNode launches (`fedmvp join`, `edge-client join`): no telemetry,
no update check, no runtime dependency installation (a device or site installs nothing it was
not given). Here, in the leaf, because the simulation lives in ``fedmvp`` and the edge launch
may not import ``fedmvp``. Each user adds only its own process's settings (Ray's, Hugging Face's).
"""

from __future__ import annotations

FLOWER_QUIET_ENV: dict[str, str] = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
                                    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
