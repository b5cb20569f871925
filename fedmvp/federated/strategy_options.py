"""What a FedMVP strategy is built from: the run's facts and its round rules, one typed record.

The ServerApp fills it from the run directory (``server_app._run_rounds``); tests fill the few fields
they need. Every server mode (``server_modes``) takes the same options and a ``RoundWriter``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fedmvp_formats.privacy import PrivacyRecord

from fedmvp.federated.privacy_budget import Event
from fedmvp.federated.replies import ClassRules
from fedmvp.federated.site_keys import SiteKeys
from fedmvp.federated.site_registry import OpenSites
from fedmvp.presets.server import ServerSpec


@dataclass(frozen=True)
class RoundPolicy:
    """How rounds run: the fraction of sites asked each round and the run's server rules (the run
    record's ``server``, one definition: fedmvp/presets/server.py; docs/architecture.md)."""

    fraction: float = 1.0
    server: ServerSpec = field(default_factory=ServerSpec)


@dataclass
class StrategyOptions:
    """A strategy's settings; each field's comment says what it is for."""

    # What every round's message carries besides the round's own values: ``preset``, ``device``,
    # ``threads``, ``class_set``; ``method`` and ``local`` as dicts (``fedmvp_formats.messages``).
    client_config: dict[str, Any] = field(default_factory=dict)
    seed: int = 0  # the run's seed: which sites each round samples (a resumed run replays exactly)
    total_rounds: int = 1  # the run's rounds (the cosine schedule's length; the last one is evaluated)
    base_lr: float = 0.0  # round 1's learning rate (cosine decay over the rounds)
    num_clients: int = 0  # sites in the federation (an open one: numbered so far)
    run_id: str = ""  # every reply must name it
    # The most training images a site may report (None: its folder's, bounded by site_max_examples);
    # None: unbounded.
    declared_examples: dict[int, int | None] | None = None
    site_names: dict[int, str] | None = None  # a [federation] run's site names by id (a reply must carry its own)
    federation: dict | None = None  # the run record's federation: which site evaluates which set
    class_rules: ClassRules | None = None  # the classes each site may claim
    policy: RoundPolicy = field(default_factory=RoundPolicy)  # fraction and [server] rules
    round_offset: int = 0  # rounds already recorded (a resumed run's server round 1 is round offset + 1)
    lora_clients: Iterable[int] = ()  # sites that train the LoRA (from the last checkpoint)
    open_sites: OpenSites | None = None  # an open federation: sites, names and rules grow with its registry
    site_keys: SiteKeys | None = None  # listed sites bound to a node key (site_keys.py)
    privacy: PrivacyRecord | None = None  # the run's [privacy] (None: none)
    privacy_events: Iterable[Event] = ()  # the recorded rounds' privacy events (privacy_budget.run_events)
    eval_every: int = 0  # evaluate every this many rounds (0: only the last round)

    def due(self, round_number: int) -> bool:
        """Whether the nodes evaluate global round ``round_number`` (the last one always)."""
        return round_number == self.total_rounds or bool(self.eval_every and round_number % self.eval_every == 0)
