"""The privacy budget: epsilon of a run's rounds so far, by Google's dp-accounting (RDP), never a formula of ours.

Each round that applied ``[privacy]`` records its event in its state.json ``privacy`` (``round_record``):
the noise multiplier z and the sampling rate q it ran with. Central mode: q is the share of the
population the round asked (``[train] fraction_fit`` online; 1 for `fedmvp ingest`, whose senders
are not sampled by the server), each round a Poisson-subsampled Gaussian mechanism. Local mode:
each device's own release is a Gaussian mechanism (q = 1), and the epsilon reported is a device's
that sent an update in every round so far (the most any device can have spent). Epsilon at
``target_delta`` composes every recorded round plus the one about to be written; a round that would
take it past ``max_epsilon`` is refused (`BudgetExceeded`, one line) before anything is written or sent.
docs/howto/privacy.md.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from typing import Any, Iterator

from fedmvp_formats.privacy import RECORD, PrivacyRecord

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


def sampling_rate(settings: PrivacyRecord, fraction: float) -> float:
    """q of a round: the share asked in central mode; 1 in local mode (a device's own release)."""
    return 1.0 if settings.mode == "local" else float(fraction)


def run_events(run: RunDir, through: int | None = None) -> list[Event]:
    """Every recorded round's event (rounds up to ``through``), in order, from their state.json."""
    events = []
    for number in run.rounds():
        if through is not None and number > through:
            break
        path = run.round_path(number) / "state.json"
        try:
            record = json.loads(path.read_text()).get(RECORD)
        except (OSError, ValueError) as err:
            raise RunError(f"{path}: unreadable ({err})") from None
        if isinstance(record, dict):
            events.append((float(record["sampling_rate"]), float(record["noise_multiplier"])))
    return events


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


def round_record(settings: PrivacyRecord, q: float, spent: float, rounds: int) -> dict[str, Any]:
    """What a round's state.json keeps of its privacy: the settings, q, epsilon and how many rounds it covers."""
    return {**settings.record(), "sampling_rate": q, "epsilon": spent, "delta": settings.target_delta,
            "dp_rounds": rounds}


def round_privacy(run: RunDir, round_number: int) -> dict[str, Any] | None:
    """What a round's weights have spent, as `fedmvp evaluate` reports it and the exported bundle's manifest
    records it: the run's settings, epsilon at ``target_delta`` over the DP rounds up to ``round_number``,
    and how many they are (None: the run has no ``[privacy]``)."""
    settings = run.privacy()
    if settings is None:
        return None
    events = run_events(run, round_number)
    return round_record(settings, events[-1][0] if events else 0.0, epsilon(events, settings.target_delta),
                        len(events))
