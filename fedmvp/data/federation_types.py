"""What a materialised federation is: its clients and evaluation sets (``federation.py`` builds the
whole, ``site_federation.py`` a [federation]'s sites; both from ``federation_plan.py``'s plan)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedmvp.attributes.sentences import SentenceStyle
from fedmvp.data.federation_plan import eval_set_name
from fedmvp.presets.schema import Preset

Sample = tuple[str, int]


@dataclass
class ClientData:
    """One client: its own label space (labels 0..c-1), k-shot train set, local test set, phrases."""

    client_id: int
    name: str
    dataset: str
    domain: str | None
    class_names: list[str]
    train: list[Sample]
    test: list[Sample]
    attributes: dict[str, list[str]]
    style: SentenceStyle
    global_labels: list[int] = field(default_factory=list)  # dataset label of each own class
    duplicate_images: int = 0  # a site folder's byte-identical copies, counted once (site_folder)


@dataclass
class EvalSet:
    """A global-model test set: ``samples`` labelled in ``class_names``' space."""

    kind: str  # "base" | "new" | "domain"
    dataset: str
    domain: str | None
    class_names: list[str]
    samples: list[Sample]
    style: SentenceStyle
    attributes: dict[str, list[str]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return eval_set_name(self.dataset, self.kind, self.domain)


@dataclass
class Federation:
    """Clients, evaluation sets and round sampling of one preset."""

    clients: list[ClientData]
    evaluations: list[EvalSet]
    fraction_per_round: float
    protocol: str
    seed: int = 0
    preset: Preset | None = field(default=None, repr=False)

    @property
    def clients_per_round(self) -> int:
        return max(1, round(len(self.clients) * self.fraction_per_round))

    def record(self) -> dict[str, Any]:
        """What later readers of a run need of the federation (config.json), without building it."""
        return {
            "clients": [{"id": c.client_id, "name": c.name, "dataset": c.dataset, "domain": c.domain,
                         "classes": list(c.class_names), "train_images": len(c.train), "test_images": len(c.test)}
                        for c in self.clients],
            "evaluations": [{"name": e.name, "kind": e.kind, "dataset": e.dataset, "domain": e.domain,
                             "classes": list(e.class_names), "images": len(e.samples)} for e in self.evaluations],
        }


def relabel(samples: list[Sample], labels: list[int]) -> list[Sample]:
    """Samples of ``labels`` only, relabelled to positions in ``labels``."""
    pos = {y: i for i, y in enumerate(labels)}
    return [(p, pos[y]) for p, y in samples if y in pos]
