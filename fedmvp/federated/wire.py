"""The wire, in one place: Flower ArrayRecords <-> numpy <-> torch, and the message schema's plain
records (``fedmvp_formats.messages``) <-> a message's one Flower ConfigRecord.

Every trainable tensor travels under its stable name (``promptformer.*``, ``lora.*``;
docs/architecture.md "Names that travel"), float32, in sorted order, so a reply's bytes do not
depend on dictionary order. In a message they travel packed (``fedmvp_formats.packed``: .npy bytes and
a ``layout``; ``state_records``, ``content_state``), folded with every schema record into the message's
ONE ConfigRecord (``fedmvp_formats.envelope``; ``records_content``, ``content_records``): Flower stores
such a message as 3 objects (``message_objects`` counts them as Flower does). The Strategy API's
ArrayRecords, which never leave the server, keep one Array per name (``array_record``, ``numpy_state``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, no_object_id_recompute

from fedmvp_formats.envelope import RECORD, fold, read_envelope
from fedmvp_formats.messages import ARRAYS, CONFIG, Instruction, read_instruction
from fedmvp_formats.packed import LAYOUT, packed_records, read_wire

from fedmvp_formats.promptformer import promptformer_digest  # noqa: F401  (the round's digest, for callers)


def array_record(state: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in sorted(state.items())})


def numpy_state(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in record.items()}


Records = dict[str, dict[str, Any]]  # the schema's records: name -> {key: ConfigRecord value}


def state_records(state: dict[str, np.ndarray]) -> Records:
    """A state as a message's records: ``arrays`` (the packed .npy bytes) and its ``layout``; no
    tensors: none (``fedmvp_formats.packed.packed_records``)."""
    return packed_records(state)


def records_content(records: Records) -> RecordDict:
    """A message's content: its records folded into ONE ConfigRecord (3 Flower objects a message)."""
    return RecordDict({RECORD: ConfigRecord(fold(records))})


def content_records(content: RecordDict) -> Records:
    """The schema's records of a message's content: one ConfigRecord, every key folded
    (``fedmvp_formats.envelope.read_envelope``); `MessageError` otherwise. Each reader checks its own."""
    return read_envelope(content, content.config_records)


def content_state(content: RecordDict) -> dict[str, np.ndarray]:
    """The tensors a message's content carries, judged before use (`MessageError` otherwise)."""
    records = content_records(content)
    return read_wire(records.get(ARRAYS), records.get(LAYOUT))


def message_objects(message: Message | RecordDict) -> int:
    """The objects Flower stores for ``message`` (or a content, without its Message object): as its
    push does, the distinct object ids of its tree (``get_all_nested_objects``): the Message, its
    RecordDict, each record, each Array and each ArrayChunk (docs/benchmarks.md "deploy"). Each id is
    computed once, as Flower's grid does while it pushes (``no_object_id_recompute``)."""
    with no_object_id_recompute():
        return len(get_all_nested_objects(message))


def to_numpy_state(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().float().numpy() for k, v in state.items()}


def to_torch_state(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(v, dtype=np.float32, copy=True)) for k, v in arrays.items()}


def content_torch_state(content: RecordDict) -> dict[str, torch.Tensor]:
    """The tensors a message's content carries, as a model state."""
    return to_torch_state(content_state(content))


def instruction_content(arrays: ArrayRecord | Records, instruction: Instruction,
                        config: ConfigRecord | None = None, extra: Records | None = None) -> RecordDict:
    """A message's content: ``arrays`` (or its ``state_records``, packed once for many messages), the
    instruction's records (``config``: the Strategy API's ConfigRecord, whose values join the
    instruction's ``config`` record) and ``extra`` records (a proof request), all in one ConfigRecord."""
    tensors = state_records(numpy_state(arrays)) if isinstance(arrays, ArrayRecord) else arrays
    records = instruction.records()
    records[CONFIG] = {**dict(config or {}), **records[CONFIG]}
    return records_content({**tensors, **records, **(extra or {})})


def content_instruction(content: RecordDict) -> Instruction:
    """The instruction a message carries, every value checked (`MessageError` otherwise)."""
    return read_instruction(content_records(content))


def node_contents(instruction: Instruction, config: ConfigRecord, site_of: Callable[[int], int | None]
                  ) -> Callable[[int, ArrayRecord], RecordDict]:
    """node, tensors -> its message's content, each made once: one per set of tensors, which every node
    gets, or, where ``site_of(node)`` gives an id (an open federation's site), one per site carrying it
    (``Instruction.site``, each node its own)."""
    made: dict[tuple[int, int | None], RecordDict] = {}
    packed: dict[int, Records] = {}  # packed once per set

    def content(node: int, arrays: ArrayRecord) -> RecordDict:
        key = (id(arrays), site_of(node))
        if key not in made:
            if key[0] not in packed:
                packed[key[0]] = state_records(numpy_state(arrays))
            tensors = packed[key[0]]
            own = instruction if key[1] is None else replace(instruction, site=key[1])
            made[key] = instruction_content(tensors, own, config)
        return made[key]
    return content
