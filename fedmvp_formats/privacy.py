"""Differential privacy for device updates: the settings' one definition and the clip and the noise.

Why here: the settings travel from the preset's ``[privacy]`` table (``fedmvp.presets.schema``)
to config.json, to every round's Flower message (its own ``privacy`` record,
``fedmvp_formats.messages``) and to the exported bundle's manifest (``privacy`` section,
``fedmvp_formats.bundle_manifest``), and the server, a site and the edge device (which imports
nothing of ``fedmvp``) all read them: one record, its fields' types, defaults, ranges and help
declared once below. The device's clip and local noise are numpy here, so `edge-client train`,
an edge node and a site's ClientApp do the same arithmetic the server's tests hold them to.

The mechanism (docs/howto/privacy.md): an update is a delta against the LoRA its sender started
from; every delta is clipped to ``clip_norm`` (L2 over all LoRA tensors together). ``central``:
the server averages m clipped deltas with equal weights and adds N(0, (z C / m)^2) to every
coordinate (``fedmvp.federated.aggregate``). ``local``: the sender adds N(0, (z C)^2) itself
before the update leaves it. Accounting is the server's (``fedmvp.federated.privacy_budget``,
Google's dp-accounting), never a formula of ours.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedmvp_formats.record import Bound, OneOf, Record, record_field, type_ok

CENTRAL, LOCAL = "central", "local"
MODES = (CENTRAL, LOCAL)
RECORD = "privacy"  # the config.json key, the message record's name and the manifest's section
# The ranges a run can account and apply (docs/howto/privacy.md): past them dp-accounting overflows
# (z = 1e300) or the noise z C leaves float32 (clip_norm = 1e300), so a preset is refused before anything
# is written. z below 1e-6 adds no noise worth the name; above 1e4 the noise swamps any LoRA.
NOISE_MULTIPLIER_RANGE = (1e-6, 1e4)
CLIP_NORM_MAX = 1e3
TARGET_DELTA_MIN = 1e-30


class PrivacyError(ValueError):
    """A privacy record out of type or range; one line naming where it came from and the key."""


def _g(value: float) -> str:
    return f"{value:g}"


_POSITIVE = Bound(0, above=True, finite=True, shows=str)


@dataclass(frozen=True)
class PrivacyRecord(Record):
    """The ``[privacy]`` table: no table, no differential privacy (docs/howto/privacy.md)."""

    ERROR = PrivacyError
    NAME = "privacy record"
    PREFIX = "privacy "
    EXTRA_KEYS = True  # keys besides these, e.g. a manifest's ``epsilon``, are the writer's and ignored

    clip_norm: float = record_field(0.1, "C: every update's LoRA delta is clipped to this L2 norm (all LoRA "
                                         "tensors together) before it counts",
                                    _POSITIVE, Bound(high=CLIP_NORM_MAX, shows=_g))
    noise_multiplier: float = record_field(1.0, "z: Gaussian noise of standard deviation z * C (local) or z * C / m "
                                                "(central, m clipped deltas averaged)",
                                           _POSITIVE, Bound(*NOISE_MULTIPLIER_RANGE, shows=_g))
    target_delta: float = record_field(1e-5, "delta at which epsilon is reported and bounded",
                                       Bound(TARGET_DELTA_MIN, 1, below=True))
    mode: str = record_field(CENTRAL, "'central': the server adds the noise to the mean of the clipped deltas; "
                                      "'local': each device adds it before its update leaves (offline update "
                                      "files)", OneOf(MODES))
    max_epsilon: float | None = record_field(8.0, "a run refuses a round that would take epsilon past this (none: "
                                                  "no bound, epsilon still reported)", _POSITIVE,
                                             absent_ok=True)  # a message leaves None out

    @classmethod
    def type_problem(cls, name: str, value: Any) -> str | None:
        """"clip_norm 'x' is not a number": the record's own wording (NaN passes here; its range refuses it)."""
        hint = typing.get_type_hints(cls)[name]
        return None if type_ok(value, hint) else f"{name} {value!r} is not {'a string' if hint is str else 'a number'}"

    @classmethod
    def not_a_record(cls, where: str, record: Any) -> str:
        return f"{where}: the privacy record must be a mapping, got {type(record).__name__}"

    @classmethod
    def shape_problem(cls, where: str, missing: list[str], unknown: list[str]) -> str:
        return f"{where}: privacy record lacks {', '.join(missing)}"


def device_privacy(own: PrivacyRecord | None, sent: PrivacyRecord | None) -> PrivacyRecord | None:
    """What an online device obeys: the round's settings (``sent``, the run's), except that the local
    noise its own bundle asks for (``own``, the manifest's, set when the device was given the bundle) is a
    floor a server cannot lower: a message without privacy, in central mode, with a larger ``clip_norm`` or
    a smaller ``noise_multiplier`` does not weaken it (docs/howto/privacy.md)."""
    if own is None or own.mode != LOCAL:
        return sent
    if sent is not None and sent.mode == LOCAL and sent.clip_norm <= own.clip_norm \
            and sent.noise_multiplier >= own.noise_multiplier:
        return sent
    return own


def privacy_fields() -> tuple[Any, ...]:
    """The record's fields (name, default, ``metadata["help"]``): the ``[privacy]`` table's keys."""
    return PrivacyRecord.record_fields()


# ---- the sender's side: the delta clipped, and (local mode) noised -----------------------------------------
def delta_norm(delta: Mapping[str, np.ndarray]) -> float:
    """The L2 norm of a delta over all its tensors together (float64)."""
    return math.sqrt(sum(float(np.sum(np.square(np.asarray(v, np.float64)))) for v in delta.values()))


def clip_delta(delta: Mapping[str, np.ndarray], clip_norm: float) -> tuple[dict[str, np.ndarray], float]:
    """(``delta`` scaled onto L2 norm ``clip_norm`` when longer, else as it is; its norm before), float64."""
    norm = delta_norm(delta)
    scale = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    return {k: np.asarray(v, np.float64) * scale for k, v in delta.items()}, norm


def privatise(trained: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray], settings: PrivacyRecord,
              rng: np.random.Generator | None = None) -> tuple[dict[str, np.ndarray], float]:
    """What a sender sends under ``settings``: ``start`` plus its delta ``trained - start`` clipped to
    ``clip_norm`` and, in local mode, plus N(0, (z C)^2) per coordinate (``rng``: default fresh OS
    entropy, never a seed an observer could know). Returns (float32 tensors, the delta's norm before
    clipping). ``start``: the LoRA the server subtracts (the round's global LoRA, or the bundle's)."""
    delta = {k: np.asarray(trained[k], np.float64) - np.asarray(start[k], np.float64) for k in sorted(trained)}
    clipped, norm = clip_delta(delta, settings.clip_norm)
    if settings.mode == LOCAL:
        rng = rng if rng is not None else np.random.default_rng()
        sigma = settings.noise_multiplier * settings.clip_norm
        clipped = {k: v + rng.normal(0.0, sigma, size=v.shape) for k, v in clipped.items()}
    return {k: (np.asarray(start[k], np.float64) + v).astype(np.float32) for k, v in clipped.items()}, norm
