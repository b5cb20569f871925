"""The wire, in one place: Flower ArrayRecords <-> numpy <-> torch, and the message schema's plain
records (``fedmvp_formats.messages``) <-> Flower ConfigRecords.

Every trainable tensor travels under its stable name (``promptformer.*``, ``lora.*``;
docs/architecture.md "Names that travel"), float32, in sorted order, so a reply's bytes do not
depend on dictionary order. In a message they travel packed (``fedmvp_formats.packed``: one Array
and a ``layout`` record; ``state_records``, ``content_state``); the Strategy API's ArrayRecords, which
never leave the server, keep one Array per name (``array_record``, ``numpy_state``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedmvp_formats.messages import ARRAYS, CONFIG, Instruction, read_instruction
from fedmvp_formats.packed import LAYOUT, PACKED, pack, read_wire

from fedmvp_formats.promptformer import promptformer_digest  # noqa: F401  (the round's digest, for callers)


def array_record(state: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in sorted(state.items())})


def numpy_state(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in record.items()}


def state_records(state: dict[str, np.ndarray]) -> dict[str, ArrayRecord | ConfigRecord]:
    """A state as a message's records: ``arrays`` (one packed Array) and its ``layout``; no tensors:
    an empty ``arrays`` record alone."""
    if not state:
        return {ARRAYS: ArrayRecord()}
    flat, layout = pack(state)
    return {ARRAYS: ArrayRecord({PACKED: Array(flat)}), LAYOUT: ConfigRecord(layout)}


def content_state(content: RecordDict) -> dict[str, np.ndarray]:
    """The tensors a message's content carries, judged before use (`MessageError` otherwise)."""
    return read_wire(content[ARRAYS], content[LAYOUT] if LAYOUT in content else None)


def to_numpy_state(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().float().numpy() for k, v in state.items()}


def to_torch_state(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(v, dtype=np.float32, copy=True)) for k, v in arrays.items()}


def content_torch_state(content: RecordDict) -> dict[str, torch.Tensor]:
    """The tensors a message's content carries, as a model state."""
    return to_torch_state(content_state(content))


def instruction_content(arrays: ArrayRecord | dict[str, ArrayRecord | ConfigRecord], instruction: Instruction,
                        config: ConfigRecord | None = None) -> RecordDict:
    """A message's content: ``arrays`` (or its ``state_records``, packed once for many messages) and the
    instruction's records, each a ConfigRecord (``config``: an existing ConfigRecord the instruction's
    scalars are written into)."""
    tensors = state_records(numpy_state(arrays)) if isinstance(arrays, ArrayRecord) else arrays
    records = instruction.records()
    config = ConfigRecord() if config is None else config
    for key, value in records.pop(CONFIG).items():
        config[key] = value
    others = {name: ConfigRecord(values) for name, values in records.items()}
    return RecordDict({**tensors, CONFIG: config, **others})


def content_instruction(content: RecordDict) -> Instruction:
    """The instruction a message carries, every value checked (`MessageError` otherwise)."""
    return read_instruction({name: dict(record) for name, record in content.config_records.items()})


def node_contents(instruction: Instruction, config: ConfigRecord, site_of: Callable[[int], int | None]
                  ) -> Callable[[int, ArrayRecord], RecordDict]:
    """node, tensors -> its message's content, each made once: one per set of tensors, which every node
    gets, or, where ``site_of(node)`` gives an id (an open federation's site), one per site carrying it
    (``Instruction.site``, each node its own; ``config`` copied, as a content's records are written into)."""
    made: dict[tuple[int, int | None], RecordDict] = {}
    packed: dict[int, dict[str, ArrayRecord | ConfigRecord]] = {}  # packed (and hashed by Flower) once per set

    def content(node: int, arrays: ArrayRecord) -> RecordDict:
        key = (id(arrays), site_of(node))
        if key not in made:
            if key[0] not in packed:
                packed[key[0]] = state_records(numpy_state(arrays))
            tensors = packed[key[0]]
            made[key] = instruction_content(tensors, instruction, config) if key[1] is None else \
                instruction_content(tensors, replace(instruction, site=key[1]), ConfigRecord(dict(config)))
        return made[key]
    return content
