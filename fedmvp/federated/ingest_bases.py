"""The rounds an update file can be a delta against, read from the run's checkpoints once each.

`fedmvp ingest` takes each file's delta against the LoRA of the round it was trained from, bounds its
norm from there, and identifies that round by content: its PromptFormer digest and its base digest
(``fedmvp_formats.promptformer``: PromptFormer and LoRA), never by the number the file writes beside them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedmvp_formats.names import LORA_PREFIX, PROMPTFORMER_PREFIX
from fedmvp_formats.promptformer import base_digest, promptformer_digest

from fedmvp.federated.wire import to_numpy_state
from fedmvp.runs import RunDir, RunError


class BaseLoras:
    """The LoRA of each round an update's bundle came from, read from the run's checkpoints once each:
    an update is a delta against it (and its norm bound is measured from it)."""

    def __init__(self, run: RunDir, last: int, lora: dict[str, np.ndarray], tensors: dict[str, Any] | None = None):
        self.run, self.loaded, self.digests = run, {last: lora}, {}
        self.states: dict[int, str] = {}  # round -> its base digest, hashed once per ingest, not once per file
        if tensors is not None:
            self.digests[last] = promptformer_digest(to_numpy_state(_promptformer(tensors)))

    def state(self, round_number: int) -> str:
        """Round ``round_number``'s base digest (its PromptFormer and LoRA): what an update of it names."""
        if round_number not in self.states:
            self.states[round_number] = base_digest(self.promptformer(round_number), self(round_number))
        return self.states[round_number]

    def find(self, digest: str, rounds: range) -> int | None:
        """The newest of ``rounds`` the run holds whose state is ``digest``, or None."""
        held = set(self.run.rounds())
        return next((n for n in reversed(rounds) if n in held and self.state(n) == digest), None)

    def __call__(self, round_number: int) -> dict[str, np.ndarray]:
        if round_number not in self.loaded:
            self._load(round_number)
        return self.loaded[round_number]

    def promptformer(self, round_number: int) -> str:
        """The digest of round ``round_number``'s PromptFormer: what an update of it was trained over."""
        if round_number not in self.digests:
            self._load(round_number)
        return self.digests[round_number]

    def _load(self, round_number: int) -> None:
        if round_number not in self.run.rounds():
            raise RunError(f"the run holds no round {round_number} (the update's base) any more")
        tensors = self.run.load_checkpoint(round_number).tensors
        self.loaded[round_number] = to_numpy_state({k: v for k, v in tensors.items() if k.startswith(LORA_PREFIX)})
        self.digests[round_number] = promptformer_digest(to_numpy_state(_promptformer(tensors)))


def _promptformer(tensors: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in tensors.items() if k.startswith(PROMPTFORMER_PREFIX)}
