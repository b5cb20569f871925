"""Privacy per device in `fedmvp ingest`: under ``[privacy]``, one update per device per release.

Why: the accountant charges every participant of a release once (``privacy_budget``). A device that sent
two update files into one release would be in it twice: under central DP its data would move the
result by twice the clipped bound the noise is calibrated to, under local DP it would have spent two
releases where one is recorded. So before a private round is written, each device's newest accepted
file is kept and its others are refused with one line; a later ingest (another release, charged again)
may take them. It runs before one training's copies are resolved (``ingest_duplicates``): a copy of a
device's newest file under another id must not let the device's older file in beside it. A device is its
update files' ``device_id`` (``edge_client.device_id``: trusted, since it
protects the device's own data), a region its ``region_run_id``; a file naming neither is refused,
because it could not be charged once (docs/howto/privacy.md, "One device, one participant").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

NO_DEVICE = ("no device_id: under [privacy] a device is charged once per release, so its update must name it "
             "(edge-client writes it; an older client's file cannot be ingested into a private run)")


class _Verdict(Protocol):
    device_id: str | None
    region: dict[str, Any]
    created: str
    sha256: str | None
    file: str
    reason: str | None
    arrays: Any

    @property
    def accepted(self) -> bool: ...


def newest_first(group: Sequence[_Verdict]) -> list[_Verdict]:
    """Of files of which one counts, the newest first (time written, then sha256): the one order every such
    choice of `fedmvp ingest` uses, so it depends on the files, never on argument order."""
    return sorted(group, key=lambda v: (v.created, v.sha256 or ""), reverse=True)


def participant(verdict: _Verdict) -> str | None:
    """Who a file's release charges: ``device <id>``, ``region <run id>``, or None (unknown)."""
    if verdict.region.get("region_run_id"):
        return f"region {verdict.region['region_run_id']}"
    return f"device {verdict.device_id}" if verdict.device_id else None


def one_per_device(verdicts: Sequence[_Verdict], max_reason: int) -> None:
    """Of the accepted files, refuse those naming no device and all but the newest of each device (in place);
    which one is kept depends on the files (time written, then sha256), never on argument order."""
    groups: dict[str, list[_Verdict]] = {}
    for verdict in verdicts:
        if not verdict.accepted:
            continue
        who = participant(verdict)
        if who is None:
            verdict.arrays, verdict.reason = None, NO_DEVICE[:max_reason]
            continue
        groups.setdefault(who, []).append(verdict)
    for who, group in groups.items():
        kept, *others = newest_first(group)
        for verdict in others:
            verdict.arrays = None
            verdict.reason = (f"{who[:19]} sent {kept.file} into this release too, which is newer: under [privacy] "
                              f"a device is one participant of a release (ingest this file in a later one)"
                              )[:max_reason]
