"""What an online round's release is charged under ``[privacy]``, and whether it is charged at all.

The accountant (``privacy_budget``) composes Poisson-subsampled Gaussian mechanisms. A round is charged
its sampling rate q = ``[train] fraction_fit`` only where that is what happened: central mode, the edge
devices drawn by Poisson sampling from OS entropy on the round's first draw (``sampling.poisson_edges``),
and no site's LoRA in the release (sites are drawn from the run's public seed, a fixed number of them).
Everything else (a population too small for Poisson sampling, a draw made again after one came up
short, a site's LoRA, local mode, a buffered version) is charged q = 1. A release that added no noise (no
LoRA delta in it: its sites trained the PromptFormer) is charged nothing and carries no epsilon; a round
whose PromptFormer moved says plainly that it is not private. docs/howto/privacy.md.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from logging import WARNING
from typing import Any

from flwr.supercore import log

from fedmvp_formats.names import LORA_PREFIX, PROMPTFORMER_PREFIX
from fedmvp_formats.privacy import CENTRAL, PrivacyRecord

from fedmvp.federated.privacy_budget import Event
from fedmvp.federated.sampling import poisson_edges, poisson_fits, sample_edges

POISSON, FIXED, REDRAWN, BUFFERED = "poisson", "fixed", "redrawn", "buffered"  # how a release's devices came


@dataclass(frozen=True)
class Draw:
    """How a round's edge devices were drawn (``kind``, one of the above) out of how many connected."""

    kind: str = FIXED
    population: int = 0


def draw_edges(privacy: PrivacyRecord | None, fraction: float, pool: Sequence[int], seed: int, round_number: int,
               attempt: int, tries: int, factor: float = 1.0) -> tuple[list[int], Draw]:
    """The round's edge devices out of ``pool``: under ``[privacy]`` with a population large enough,
    Poisson sampling from OS entropy (``tries``/``attempt`` > 0: a draw made again, ``REDRAWN``);
    otherwise the run's seeded draw of a fixed number (``sampling.sample_edges``), over-selected by
    ``factor`` ([server] over_selection; a Poisson draw never is: ``dropouts``)."""
    if privacy is not None and poisson_fits(fraction, len(pool)):
        return poisson_edges(fraction, pool), Draw(POISSON if attempt == 0 and tries == 0 else REDRAWN, len(pool))
    return sample_edges(seed, fraction, pool, round_number, attempt, factor), Draw(FIXED, len(pool))


def round_rate(privacy: PrivacyRecord, fraction: float, draw: Draw, lora_sites: Collection[int]) -> float:
    """q charged for a round: ``fraction`` only for a first Poisson draw in central mode with no site's
    LoRA in the release; 1 otherwise (a participant there was in with certainty, or predictably)."""
    if privacy.mode == CENTRAL and draw.kind == POISSON and not lora_sites:
        return float(fraction)
    return 1.0


def _sends(arrays: Iterable[str], prefix: str) -> bool:
    return any(k.startswith(prefix) for k in arrays)


def release(charged: dict[str, Any], step_privacy: dict[str, Any] | None, draw: Draw, events: list[Event],
            round_number: int, contents: Sequence[tuple[int | None, str, int | None, Collection[str]]]
            ) -> dict[str, Any]:
    """What the round's summary gets: ``privacy``, its state.json record (absent where no noise was added:
    nothing charged, its event not appended to ``events``), and ``not_private``, why the round is not
    private (logged). ``contents``: per accepted update (node, role, site, tensor names). The record lists
    who was in the release (``contributors``: the nodes whose LoRA delta it holds), how they were drawn and
    out of how many, so the epsilon can be recomputed from what happened."""
    record, reason = _release(charged, step_privacy, draw, contents)
    if record is not None:
        events.append((float(record["sampling_rate"]), float(record["noise_multiplier"])))
    if reason is not None:
        log(WARNING, "round %s: %s", round_number, reason)
    return {**({"privacy": record} if record is not None else {}),
            **({"not_private": reason} if reason is not None else {})}


def _release(charged: dict[str, Any], step_privacy: dict[str, Any] | None, draw: Draw,
             contents: Sequence[tuple[int | None, str, int | None, Collection[str]]]
             ) -> tuple[dict[str, Any] | None, str | None]:
    """(the record, None where no LoRA delta was noised; the not-private line, None where none applies)."""
    lora = [(node, role, site) for node, role, site, names in contents if _sends(names, LORA_PREFIX)]
    promptformer = sorted({site for _, role, site, names in contents
                           if role != "edge" and site is not None and _sends(names, PROMPTFORMER_PREFIX)})
    reason = None
    if promptformer:
        reason = (f"not differentially private: site{'s' if len(promptformer) > 1 else ''} "
                  f"{', '.join(map(str, promptformer))} trained the PromptFormer, which [privacy] does not cover "
                  f"(no noise added to it)")
    if not lora:  # nothing noised: no epsilon for this release (docs/howto/privacy.md)
        return None, reason and f"{reason}; no LoRA update, no epsilon charged"
    record = {**charged, **(step_privacy or {}), "sampling": draw.kind, "population": draw.population,
              "contributors": sorted(node for node, _, _ in lora if node is not None),
              "contributor_sites": sorted(site for _, role, site in lora if role != "edge" and site is not None)}
    return record, reason
