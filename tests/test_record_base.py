"""fedmvp_formats.record, the one base of the method, server and privacy records: the type and range
lines, the shape, and version migration, on a record of its own (each real record's lines are held
by tests/test_method_record.py, tests/test_presets.py and tests/federated/test_privacy.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from fedmvp.presets.server import ServerSpec
from fedmvp_formats.method import MethodRecord
from fedmvp_formats.privacy import PrivacyRecord
from fedmvp_formats.record import Bound, Names, OneOf, Record, record_field

WHERE = "runs/x/toy.json"


class ToyError(ValueError):
    pass


@dataclass(frozen=True)
class Toy(Record):
    """A versioned record of every kind of field the real ones declare."""

    ERROR = ToyError
    NAME = "toy record"
    PREFIX = "toy record: "
    VERSION = 3
    steps = {1: lambda r: {**{k: v for k, v in r.items() if k != "old_rate"}, "rate": r["old_rate"] / 100}}

    count: int = record_field(2, "how many", Bound(1))
    rate: float = record_field(0.5, "a share", Bound(0.0, 1.0))
    limit: float | None = record_field(None, "a bound (none: no bound)", Bound(0, above=True, finite=True))
    kind: str = record_field("a", "which", OneOf(("a", "b", "c")))
    parts: tuple[str, ...] = record_field(("x",), "parts", Names(("x", "y"), "part"))
    flag: bool = record_field(True, "a switch")
    extra: int = record_field(7, "added by version 3", Bound(0), since=3)


def _good(**changes: Any) -> dict[str, Any]:
    return {**Toy().record(), **changes}


def _line(record: Any) -> str:
    with pytest.raises(ToyError) as info:
        Toy.from_record(record, WHERE)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"{WHERE}: ")
    return text[len(WHERE) + 2:]


BAD = [  # field, value, the one line after "WHERE: "
    ("count", 0, "toy record: count must be at least 1, got 0"),
    ("count", 1.5, "toy record: count must be an integer, got 1.5"),
    ("count", True, "toy record: count must be an integer, got True"),
    ("rate", 1.5, "toy record: rate must be in [0.0, 1.0], got 1.5"),
    ("rate", "0.5", "toy record: rate must be a number, got '0.5'"),
    ("rate", float("nan"), "toy record: rate must be a finite number, got nan"),
    ("limit", 0.0, "toy record: limit must be a finite number > 0, got 0.0"),
    ("limit", "none", "toy record: limit must be float | None, got 'none'"),
    ("kind", "d", "toy record: kind must be 'a', 'b' or 'c', got 'd'"),
    ("kind", 1, "toy record: kind must be a string, got 1"),
    ("parts", [], "toy record: parts must be a non-empty list of names, got []"),
    ("parts", ["z"], "toy record: parts: unknown part 'z' (one of x, y)"),
    ("parts", ["x", "x"], "toy record: parts names a part twice, got ['x', 'x']"),
    ("flag", 1, "toy record: flag must be true or false, got 1"),
    ("extra", -1, "toy record: extra must be 0 or more, got -1"),
]


@pytest.mark.parametrize("name, value, says", BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_each_bad_value_is_one_line_naming_the_source_and_the_field(name, value, says):
    assert _line(_good(**{name: value})) == says
    assert Toy.field_problem(name, value) == says.removeprefix("toy record: ")


SHAPES = [
    ([1], "not a toy record (got list)"),
    ({k: v for k, v in _good().items() if k != "rate"}, "toy record does not match this fedmvp (missing rate)"),
    (_good(spare=1), "toy record does not match this fedmvp (unknown spare)"),
    (_good(version=4), "toy record version 4 is newer than this fedmvp reads (up to 3); update fedmvp"),
    (_good(version="3"), "toy record version '3' is not a version (a positive integer)"),
    (_good(version=0), "toy record version 0 is not a version (a positive integer)"),
]


@pytest.mark.parametrize("record, says", SHAPES)
def test_a_wrong_shape_or_version_is_one_line(record, says):
    assert _line(record) == says


def test_round_trip_stores_floats_and_tuples_and_writes_json_types():
    toy = Toy.from_record(json.loads(json.dumps(_good(rate=1, limit=2, parts=["y", "x"]))), WHERE)
    assert toy == Toy(rate=1.0, limit=2.0, parts=("y", "x")) and isinstance(toy.rate, float)
    assert toy.record() == _good(rate=1.0, limit=2.0, parts=["y", "x"]) and toy.record()["version"] == 3
    assert toy.with_overrides({"count": 5, "rate": None}, WHERE) == Toy(count=5, rate=1.0, limit=2.0, parts=("y", "x"))


MIGRATIONS = [  # a record as an older release wrote it, what it reads as
    ({"count": 1, "old_rate": 25, "limit": None, "kind": "b", "parts": ["x"], "flag": False},
     Toy(count=1, rate=0.25, kind="b", flag=False)),  # no version: version 1, stepped, extra filled
    ({"count": 1, "rate": 0.25, "limit": None, "kind": "b", "parts": ["x"], "flag": False, "version": 2},
     Toy(count=1, rate=0.25, kind="b", flag=False)),  # version 2: only the later field filled
]


@pytest.mark.parametrize("old, new", MIGRATIONS)
def test_an_older_record_is_migrated_step_by_step_and_later_fields_get_their_default(old, new):
    assert Toy.from_record(old, WHERE) == new
    assert Toy.migrate(old, WHERE)["version"] == 3


def test_a_current_record_missing_a_field_of_its_version_is_refused_not_filled():
    assert _line({k: v for k, v in _good().items() if k != "extra"}) == \
        "toy record does not match this fedmvp (missing extra)"


WORDING = [  # the range, a value out of it, what the line says
    (Bound(1), 0, "v must be at least 1, got 0"),
    (Bound(0), -1, "v must be 0 or more, got -1"),
    (Bound(0.0), -0.5, "v must be 0.0 or more, got -0.5"),
    (Bound(0.0, 1.0), 2.0, "v must be in [0.0, 1.0], got 2.0"),
    (Bound(1e-30, 1, below=True), 1.0, "v must be in [1e-30, 1), got 1.0"),
    (Bound(0, above=True, finite=True), float("inf"), "v must be a finite number > 0, got inf"),
    (Bound(0, finite=True), -1.0, "v must be a finite number >= 0, got -1.0"),
    (Bound(high=1e3, shows="{:g}".format), 5e3, "v must be at most 1000, got 5000"),
    (Bound(0, above=True, says="a finite number of seconds > 0"), 0, "v must be a finite number of seconds > 0, got 0"),
    (OneOf(("sync", "buffered")), "async", "v must be 'sync' or 'buffered', got 'async'"),
]


@pytest.mark.parametrize("check, value, says", WORDING, ids=[w[2] for w in WORDING])
def test_each_check_says_its_range(check, value, says):
    assert check.problem("v", value) == says
    assert isinstance(check, OneOf) or check.problem("v", None) is None  # an optional field's None passes


@pytest.mark.parametrize("cls", [MethodRecord, ServerSpec, PrivacyRecord])
def test_the_three_records_share_the_base_and_read_back_what_they_write(cls):
    """One reader and one writer: every field has help, the default record reads back as itself."""
    assert issubclass(cls, Record)
    assert all(f.metadata["help"] for f in cls.record_fields())
    assert cls.from_record(json.loads(json.dumps(cls().record())), WHERE) == cls()
    assert cls().problem() is None
