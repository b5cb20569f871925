"""A message's records folded into ONE record: what crosses Flower's SuperLink is three objects.

Why one record: Flower stores a message as objects (``Message`` -> ``RecordDict`` -> each record ->
each ``Array`` -> its ``ArrayChunk``s), and its SuperLink serves each object with a request and a
database transaction (~10 ms of its CPU each; docs/benchmarks.md "deploy"). A message of the schema's
records (``fedmvp_formats.messages``) plus a packed Array was 5 to 9 objects; folded here it is the
Message, its RecordDict and one ConfigRecord, whatever the model: the packed tensors travel as a
``bytes`` value of that record (a ConfigRecord has no children, so no Array and no chunks), the
layout and every schema record as prefixed keys (docs/architecture.md "Records that travel").

A folded key is ``<record>.<key>`` (``config.round``, ``identity.run-id``, ``layout.names``,
``arrays.tensors``): record names hold no ``.``, so the first ``.`` splits it, whatever the key
(a class name or a metric may hold dots). Flower is not imported here: the record is a plain mapping
of ConfigRecord values, wrapped at each package's edge (``fedmvp.federated.wire``, ``edge_client.node``).
``read_envelope`` judges what arrives before any reader sees it: exactly one record of that name,
every key folded, no record told twice (`MessageError`, one line).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedmvp_formats.messages import MessageError
from fedmvp_formats.shown import name_shown

RECORD = "fedmvp"  # the one ConfigRecord of a message's RecordDict
SEP = "."


def fold(records: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``{record: {key: value}}`` -> ``{"record.key": value}`` (an empty record leaves no key)."""
    out: dict[str, Any] = {}
    for name, record in records.items():
        if not name or SEP in name:
            raise ValueError(f"record name {name!r} is empty or holds {SEP!r}")
        out |= {f"{name}{SEP}{key}": value for key, value in record.items()}
    return out


def unfold(fields: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"record.key": value}`` -> ``{record: {key: value}}``; a key that is not folded: `MessageError`."""
    out: dict[str, dict[str, Any]] = {}
    for folded, value in fields.items():
        name, sep, key = str(folded).partition(SEP)
        if not isinstance(folded, str) or not name or not sep or not key:
            raise MessageError(f"{RECORD} key {name_shown(str(folded))} is not <record>{SEP}<key>")
        out.setdefault(name, {})[key] = list(value) if isinstance(value, list) else value
    return out


def read_envelope(content: Mapping[str, Any], configs: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The schema's records of a message's content (a RecordDict, as a mapping of record name -> record;
    ``configs``: its ConfigRecords, ``content.config_records``, so Flower typed every value): exactly
    one record, ``RECORD``, a ConfigRecord of folded keys. `MessageError` otherwise."""
    names = list(content)
    if names != [RECORD] or RECORD not in configs:
        shown_names = ", ".join(name_shown(str(n)) for n in names[:4]) or "none"
        raise MessageError(f"expected one {RECORD} ConfigRecord, got {len(names)} record(s) ({shown_names})")
    return unfold(configs[RECORD])
