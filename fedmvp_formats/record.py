"""The one base of the records that travel (method, server rules, privacy): declared fields, one reader.

Why here: the records are written by one package and read by another (config.json, a round's
state.json and Flower message, a bundle's manifest; docs/architecture.md "Records that travel"),
the device among the readers, so their one definition sits in the leaf. A record is a dataclass
deriving from ``Record`` whose fields are declared with ``record_field``: the default, the help
text (the preset reference is generated from it, docs/hooks/reference.py), the checks of its range
(``Bound``, ``OneOf``, ``Names``) and the record version that added it. ``from_record`` is the one
reader: the shape (missing and unknown keys), each value's type, each field's checks and the
record's own cross-field check, every problem one line naming where the record came from.

Versions (a record that sets ``VERSION``): the record carries ``version``; one without it is
``UNVERSIONED``. ``migrate`` brings an older record to the current version: each ``steps`` entry in
turn (a rename, a changed unit), then every field added later (``since``) filled with its documented
default, which must be what the code did before the field existed. A field of the record's own
version that is missing stays an error; a newer version than this release knows is refused.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

VERSION_KEY = "version"
UNVERSIONED = 1  # what a versioned record without ``version`` is: the layout written before the version existed

R = TypeVar("R", bound="Record")


# ---- the value's type -------------------------------------------------------------------------------------
def type_ok(value: Any, hint: Any) -> bool:
    """``value`` fits the field's type: no bool for a number, an int for a float, lists element-wise."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(type_ok(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(type_ok(v, args[0]) for v in value)
    if origin is tuple:  # a tuple of names travels as a JSON list: at least one, each a string
        return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, str) for v in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def type_name(hint: Any) -> str:
    """The type as an error line says it ("an integer", "a number (optional)")."""
    if isinstance(hint, type):
        return {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false"}.get(
            hint.__name__, hint.__name__)
    if typing.get_origin(hint) is tuple:
        return "a non-empty list of names"
    return str(hint).replace("typing.", "").replace("NoneType", "none").replace(" | none", " (optional)")


def is_float(hint: Any) -> bool:
    """A float field, plain or optional (its int values are stored as floats)."""
    return hint is float or typing.get_args(hint) == (float, type(None))


# ---- a field's checks -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bound:
    """The range of a number: ``low``/``high`` inclusive unless ``above``/``below`` (strict); ``finite``
    also refuses NaN and infinities and says "a finite number > low". ``says`` replaces the derived
    wording, ``shows`` formats the bounds and the value in the line. None (an optional field) passes."""

    low: float | None = None
    high: float | None = None
    above: bool = False
    below: bool = False
    finite: bool = False
    says: str | None = None
    shows: Callable[[Any], str] = repr

    def holds(self, value: float) -> bool:
        if self.finite and not math.isfinite(value):
            return False
        if self.low is not None and not (value > self.low if self.above else value >= self.low):
            return False
        return self.high is None or (value < self.high if self.below else value <= self.high)

    def wording(self) -> str:
        show, low, high = self.shows, self.low, self.high
        if self.says:
            return self.says
        if self.finite:
            return f"a finite number {'>' if self.above else '>='} {show(low)}"
        if low is not None and high is not None:
            return f"in {'(' if self.above else '['}{show(low)}, {show(high)}{')' if self.below else ']'}"
        if low is not None:
            return "at least 1" if low == 1 and isinstance(low, int) else f"{show(low)} or more"
        return f"at most {show(high)}"

    def problem(self, name: str, value: Any) -> str | None:
        if value is None or self.holds(value):
            return None
        return f"{name} must be {self.wording()}, got {self.shows(value)}"


@dataclass(frozen=True)
class OneOf:
    """A name among ``choices`` ("mode must be 'sync' or 'buffered', got 'x'")."""

    choices: tuple[str, ...]

    def problem(self, name: str, value: Any) -> str | None:
        if value in self.choices:
            return None
        said = [repr(c) for c in self.choices]
        return f"{name} must be {' or '.join([', '.join(said[:-1]), said[-1]] if len(said) > 1 else said)}, " \
               f"got {value!r}"


@dataclass(frozen=True)
class Names:
    """A list of names, each among ``choices`` and each once (``noun``: what one name is, for the line)."""

    choices: tuple[str, ...]
    noun: str = "name"

    def problem(self, name: str, value: Any) -> str | None:
        unknown = [v for v in value if v not in self.choices]
        if unknown:
            return f"{name}: unknown {self.noun} {unknown[0]!r} (one of {', '.join(self.choices)})"
        if len(set(value)) != len(value):
            return f"{name} names a {self.noun} twice, got {list(value)!r}"
        return None


Check = Bound | OneOf | Names


def record_field(default: Any, help: str, *checks: Check, since: int = 1, absent_ok: bool = False) -> Any:
    """A record field: its default, ``help`` (the preset reference's text), its ``checks`` in order,
    ``since``, the record version that added it, and ``absent_ok``: a missing key reads as None (a
    writer that leaves a None out)."""
    meta = {"help": help, "checks": checks, "since": since, "absent_ok": absent_ok}
    return field(default=default, metadata=meta)


# ---- the record -------------------------------------------------------------------------------------------
class Record:
    """A dataclass of declared fields with one reader (``from_record``) and one writer (``record``).

    A subclass names its ``ERROR`` (a ``ValueError``), ``NAME`` (the record in a line: "method
    record"), ``PREFIX`` (what precedes a field's problem), ``VERSION`` (None: not versioned) and
    ``EXTRA_KEYS`` (True: keys besides the fields are the writer's, ignored) and ``RANGES_SEE_WRITTEN``
    (a range line shows the value as written, "got -1", not as stored, "got -1.0"); the lines for a value
    that is no mapping and for a wrong set of keys are its ``not_a_record`` and ``shape_problem``."""

    ERROR: ClassVar[type[ValueError]] = ValueError
    NAME: ClassVar[str] = "record"
    PREFIX: ClassVar[str] = "record: "
    VERSION: ClassVar[int | None] = None
    EXTRA_KEYS: ClassVar[bool] = False
    RANGES_SEE_WRITTEN: ClassVar[bool] = False  # a range line shows the value as written ("got -1"), not stored
    steps: ClassVar[dict[int, Callable[[dict[str, Any]], dict[str, Any]]]] = {}

    # -- the declaration
    @classmethod
    def record_fields(cls) -> tuple[Field, ...]:
        """The fields in order (``metadata``: help, checks, since, absent_ok)."""
        return fields(cls)  # type: ignore[arg-type]

    @classmethod
    def field_named(cls, name: str) -> Field:
        """One field by name (KeyError: not a field of this record)."""
        for f in cls.record_fields():
            if f.name == name:
                return f
        raise KeyError(name)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in cls.record_fields())

    @classmethod
    def current_version(cls) -> int | None:
        """The version this release writes (None: the record is not versioned)."""
        return cls.VERSION

    # -- the checks
    @classmethod
    def type_problem(cls, name: str, value: Any) -> str | None:
        """Why ``value`` is not of the field's type ("alpha must be a number, got '10'"); None if it is."""
        hint = typing.get_type_hints(cls)[name]
        if not type_ok(value, hint):
            return f"{name} must be {type_name(hint)}, got {value!r}"
        if isinstance(value, float) and not math.isfinite(value):
            return f"{name} must be a finite number, got {value!r}"
        return None

    @classmethod
    def field_problem(cls, name: str, value: Any) -> str | None:
        """Why ``value`` cannot be the field ``name`` (its type, then its checks); None if it can."""
        problem = cls.type_problem(name, value)
        for check in () if problem else cls.field_named(name).metadata["checks"]:
            problem = check.problem(name, value)
            if problem:
                break
        return problem

    @classmethod
    def cross_problem(cls, values: Mapping[str, Any]) -> str | None:
        """A problem of several fields together (a subclass's; None here)."""
        return None

    @classmethod
    def values_problem(cls, values: Mapping[str, Any]) -> str | None:
        """The first field out of its checks, then the cross-field check (types already checked)."""
        for f in cls.record_fields():
            for check in f.metadata["checks"]:
                problem = check.problem(f.name, values[f.name])
                if problem:
                    return problem
        return cls.cross_problem(values)

    def problem(self) -> str | None:
        """The first value out of range, as one message (None: all in range)."""
        return self.values_problem({name: getattr(self, name) for name in self.keys()})

    # -- the lines (a subclass keeps its own wording)
    @classmethod
    def not_a_record(cls, where: str, record: Any) -> str:
        return f"{where}: not a {cls.NAME} (got {type(record).__name__})"

    @classmethod
    def shape_problem(cls, where: str, missing: list[str], unknown: list[str]) -> str:
        detail = "; ".join(filter(None, [f"missing {', '.join(missing)}" if missing else "",
                                         f"unknown {', '.join(unknown)}" if unknown else ""]))
        return f"{where}: {cls.NAME} does not match this fedmvp ({detail})"

    # -- versions
    @classmethod
    def record_version(cls, record: Mapping[str, Any], where: str) -> int:
        """The record's version (``UNVERSIONED`` without one); a newer or malformed one is refused."""
        current = cls.current_version() or UNVERSIONED
        version = record.get(VERSION_KEY, UNVERSIONED)
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise cls.ERROR(f"{where}: {cls.NAME} version {version!r} is not a version (a positive integer)")
        if version > current:
            raise cls.ERROR(f"{where}: {cls.NAME} version {version} is newer than this fedmvp reads "
                            f"(up to {current}); update fedmvp")
        return version

    @classmethod
    def migrate(cls, record: Any, where: str) -> dict[str, Any]:
        """``record`` brought to the current version (a record that is not versioned: as it is)."""
        if not isinstance(record, Mapping):
            raise cls.ERROR(cls.not_a_record(where, record))
        current = cls.current_version()
        if current is None:
            return dict(record)
        version = cls.record_version(record, where)
        out = dict(record)
        for step in range(version, current):
            out = cls.steps.get(step, dict)(out)
        for f in cls.record_fields():
            if f.metadata["since"] > version and f.name not in out:
                out[f.name] = list(f.default) if isinstance(f.default, tuple) else f.default
        out[VERSION_KEY] = current
        return out

    # -- reading and writing
    @classmethod
    def from_record(cls: type[R], record: Any, where: str) -> R:
        """The record as written (migrated), every key and value checked; ``ERROR`` names ``where``.

        Why strict: a reader that filled a missing key from the defaults would silently use other
        settings than the writer's (only ``migrate`` fills, and only fields added later)."""
        record = cls.migrate(record, where)
        names = cls.keys()
        absent_ok = {f.name for f in cls.record_fields() if f.metadata["absent_ok"]}
        known = set(names) | ({VERSION_KEY} if cls.current_version() is not None else set())
        unknown = [] if cls.EXTRA_KEYS else sorted(set(record) - known)
        missing = [n for n in names if n not in record and n not in absent_ok]
        if unknown or missing:
            raise cls.ERROR(cls.shape_problem(where, missing, unknown))
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in cls.record_fields():
            value = record.get(f.name)  # absent: only an ``absent_ok`` field, read as None
            problem = cls.type_problem(f.name, value)
            if problem:
                raise cls.ERROR(f"{where}: {cls.PREFIX}{problem}")
            values[f.name] = _stored(value, hints[f.name])
        problem = cls.values_problem({**values, **record} if cls.RANGES_SEE_WRITTEN else values)
        if problem:
            raise cls.ERROR(f"{where}: {cls.PREFIX}{problem}")
        return cls(**values)

    def record(self) -> dict[str, Any]:
        """What travels: every field (JSON types: lists, not tuples) and, when versioned, ``version``."""
        out = {name: list(v) if isinstance(v := getattr(self, name), tuple) else v for name in self.keys()}
        version = self.current_version()
        return out if version is None else {**out, VERSION_KEY: version}

    def subset(self, keys: tuple[str, ...]) -> dict[str, Any]:
        return {key: getattr(self, key) for key in keys}

    def with_overrides(self: R, overrides: Mapping[str, Any], where: str) -> R:
        """This record with run-time values (None: keep the record's), checked like the record itself."""
        given = {k: v for k, v in overrides.items() if v is not None}
        return type(self).from_record({**self.record(), **given}, where)


def _stored(value: Any, hint: Any) -> Any:
    """The value as the record holds it: an int of a float field as a float, a list of names as a tuple."""
    if is_float(hint) and value is not None:
        return float(value)
    if typing.get_origin(hint) is tuple:
        return tuple(value)
    return value
