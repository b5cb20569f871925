"""The privacy budget: epsilon of a run's rounds so far, by Google's dp-accounting (RDP), never a formula of ours.

Each round whose release added noise under ``[privacy]`` records its event in its state.json ``privacy``
(``round_record``): the noise multiplier z and the sampling rate q it was charged. Central mode online,
q = ``[train] fraction_fit`` only for a round whose devices were drawn by Poisson sampling from OS
entropy, else 1 (``private_rounds``); `fedmvp ingest` and buffered versions: q = 1 (the server samples
no one). Local mode: each device's own release is a Gaussian mechanism (q = 1), and the epsilon
reported is a device's that sent an update in every round so far (the most any device can have
spent). Epsilon at ``target_delta`` composes every recorded round plus the one about to be written; a
round that would take it past ``max_epsilon`` is refused (`BudgetExceeded`, one line) before anything is
written or sent. A record of an older fedmvp without ``sampling_rate`` is charged q = 1, one without
``noise_multiplier`` the run's (never less than was spent); a value that is not a number is one line.
docs/howto/privacy.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from typing import Any, Iterator

from fedmvp_formats.privacy import RECORD, PrivacyRecord
from fedmvp_formats.shown import shown

from fedmvp.runs import RunDir, RunError

Event = tuple[float, float]  # (sampling rate q, noise multiplier z) of one round


class BudgetExceeded(RuntimeError):
    """A round would take the run's epsilon past ``[privacy] max_epsilon``; the message is one line."""


@contextmanager
def _quiet_absl() -> Iterator[None]:
    """dp-accounting logs a warning per fractional RDP order it cannot bound (it drops that order)."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def dp_event(events: Sequence[Event]) -> Any:
    """The run's rounds as one dp-accounting event: runs of equal (q, z) self-composed, then composed."""
    import dp_accounting

    groups: list[tuple[Event, int]] = []
    for event in events:
        if groups and groups[-1][0] == event:
            groups[-1] = (event, groups[-1][1] + 1)
        else:
            groups.append((event, 1))
    parts = []
    for (q, z), count in groups:
        gaussian = dp_accounting.GaussianDpEvent(z)
        single = gaussian if q >= 1.0 else dp_accounting.PoissonSampledDpEvent(q, gaussian)
        parts.append(dp_accounting.SelfComposedDpEvent(single, count))
    return dp_accounting.ComposedDpEvent(parts)


def epsilon(events: Sequence[Event], delta: float) -> float:
    """Epsilon at ``delta`` of ``events`` composed (RDP accountant, dp-accounting's default orders); 0 for none."""
    if not events:
        return 0.0
    from dp_accounting.rdp import RdpAccountant

    with _quiet_absl():
        accountant = RdpAccountant()
        accountant.compose(dp_event(events))
        return float(accountant.get_epsilon(delta))


def run_events(run: RunDir, through: int | None = None) -> list[Event]:
    """Every recorded round's event (rounds up to ``through``), in order, from their state.json."""
    return [event for event, _ in _recorded(run, through) if event is not None]


def _recorded(run: RunDir, through: int | None) -> Iterator[tuple[Event | None, bool]]:
    """Per round up to ``through``: (its event, None where it records none; whether it records
    ``not_private``). A missing ``sampling_rate`` is q = 1, a missing ``noise_multiplier`` the run's."""
    settings = None
    for number in run.rounds():
        if through is not None and number > through:
            break
        path, state = run.round_state_path(number), run.round_state(number)
        record = state.get(RECORD)
        event = None
        if isinstance(record, dict):
            if "noise_multiplier" not in record and settings is None:
                settings = run.privacy()
                if settings is None:
                    raise RunError(f"{path}: privacy noise_multiplier is missing and the run records no [privacy]")
            z = record.get("noise_multiplier", settings.noise_multiplier if settings else None)
            event = (_number(record.get("sampling_rate", 1.0), "sampling_rate", path), _number(z, "noise_multiplier", path))
        yield event, "not_private" in state


def _number(value: Any, key: str, path: Any) -> float:
    """A recorded q in (0, 1] or z > 0 as a float; `RunError` (one line) for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 < value <= 1 if key == "sampling_rate" else 0 < value < float("inf")):
        raise RunError(f"{path}: privacy {key} {shown(value)} is not a usable number")
    return float(value)


def charge(settings: PrivacyRecord, before: Iterable[Event], q: float, round_number: int) -> dict[str, Any]:
    """The state.json ``privacy`` record of round ``round_number`` run at sampling rate ``q`` after the
    events ``before``; `BudgetExceeded` when its epsilon passes ``max_epsilon``."""
    events = [*before, (q, settings.noise_multiplier)]
    spent = epsilon(events, settings.target_delta)
    if settings.max_epsilon is not None and spent > settings.max_epsilon:
        raise BudgetExceeded(f"privacy budget: round {round_number} would take epsilon to {spent:.3g} at delta "
                             f"{settings.target_delta:g}, past [privacy] max_epsilon {settings.max_epsilon:g}; "
                             f"the run stops here")
    return round_record(settings, q, spent, len(events))


def round_record(settings: PrivacyRecord, q: float | None, spent: float | None, rounds: int) -> dict[str, Any]:
    """What a round's state.json keeps of its privacy: the settings, q, epsilon and how many rounds it covers."""
    return {**settings.record(), "sampling_rate": q, "epsilon": spent, "delta": settings.target_delta,
            "dp_rounds": rounds}


def round_privacy(run: RunDir, round_number: int) -> dict[str, Any] | None:
    """What a round's weights have spent, as `fedmvp evaluate` reports it and the exported bundle's manifest
    records it: the run's settings, epsilon at ``target_delta`` over the DP rounds up to ``round_number``
    (None where none added noise yet: no epsilon is claimed for weights nothing protected), how many they
    are, and how many rounds were not private (``not_private_rounds``: their sites trained the
    PromptFormer). None: the run has no ``[privacy]``."""
    settings = run.privacy()
    if settings is None:
        return None
    recorded = list(_recorded(run, round_number))
    events = [event for event, _ in recorded if event is not None]
    spent = epsilon(events, settings.target_delta) if events else None
    return {**round_record(settings, events[-1][0] if events else None, spent, len(events)),
            "not_private_rounds": sum(not_private for _, not_private in recorded)}
