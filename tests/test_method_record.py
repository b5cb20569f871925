"""fedmvp_formats.method, the one method record: validation, round trip, version and migration."""

from __future__ import annotations

import json
import types
from dataclasses import MISSING

import pytest

from fedmvp_formats import method
from fedmvp_formats.method import MethodError, MethodRecord, method_field

WHERE = "runs/x/config.json"


def _record(**changes) -> dict:
    return {**MethodRecord().to_dict(), **changes}


def _error(record) -> str:
    with pytest.raises(MethodError) as info:
        MethodRecord.from_dict(record, WHERE)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"{WHERE}: ")
    return text


BAD = [  # field, value, what the one line says
    ("num_prompts", 0, "num_prompts must be at least 1, got 0"),
    ("num_prompts", 2.5, "num_prompts must be an integer, got 2.5"),
    ("num_prompts", True, "num_prompts must be an integer, got True"),
    ("heads", -1, "heads must be at least 1, got -1"),
    ("ff_mult", "4", "ff_mult must be an integer, got '4'"),
    ("alpha", -0.5, "alpha must be 0.0 or more, got -0.5"),
    ("alpha", float("nan"), "alpha must be a finite number, got nan"),
    ("alpha", "10", "alpha must be a number, got '10'"),
    ("flip_prob", 1.5, "flip_prob must be in [0.0, 1.0], got 1.5"),
    ("flip_prob", -0.1, "flip_prob must be in [0.0, 1.0], got -0.1"),
    ("lora_rank", 0, "lora_rank must be at least 1, got 0"),
    ("lora_targets", [], "lora_targets must be a non-empty list of names, got []"),
    ("lora_targets", "to_q", "lora_targets must be a non-empty list of names, got 'to_q'"),
    ("lora_targets", ["to_q", 3], "lora_targets must be a non-empty list of names"),
    ("lora_targets", ["to_q", "to_x"], "lora_targets: unknown layer 'to_x' (one of to_q, to_k, to_v,"),
    ("lora_targets", ["to_q", "to_q"], "lora_targets names a layer twice"),
    ("use_lora", 1, "use_lora must be true or false, got 1"),
]


@pytest.mark.parametrize("name, value, says", BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_each_bad_value_is_one_line_naming_the_source_and_the_field(name, value, says):
    assert says in _error(_record(**{name: value}))


def test_missing_and_unknown_fields_are_refused_not_filled():
    record = _record(extra=1)
    del record["alpha"]
    assert "does not match this fedmvp (missing alpha; unknown extra)" in _error(record)
    assert "not a method record (got list)" in _error([1, 2])


def test_round_trip_through_json_and_fedmvp_config():
    from fedmvp.model import FedMVPConfig

    config = FedMVPConfig(num_prompts=2, alpha=0.0, flip_prob=0.25, lora_rank=3, lora_targets=("to_v", "to_q"),
                          use_lora=False)
    record = json.loads(json.dumps(config.to_dict()))
    assert record["version"] == method.VERSION and record["lora_targets"] == ["to_v", "to_q"]
    again = FedMVPConfig.from_dict(record)
    assert again == config and isinstance(again, FedMVPConfig) and again.to_dict() == record
    assert isinstance(FedMVPConfig.from_dict({**record, "alpha": 2}).alpha, float)  # JSON's 2 is the float 2.0


def test_a_record_without_version_is_migrated():
    """Every run's config.json / state.json and every bundle's manifest before the version held this."""
    old = {"num_prompts": 4, "heads": 4, "ff_mult": 4, "alpha": 5.0, "flip_prob": 0.5, "lora_rank": 4,
           "lora_targets": ["to_q", "to_k", "to_v"], "use_lora": True}
    config = MethodRecord.from_dict(old, WHERE)
    assert config.alpha == 5.0 and config.lora_rank == 4
    assert config.to_dict() == {**old, "version": method.VERSION}


@pytest.fixture
def flip_prob_added_in_version_2(monkeypatch):
    """As if this release were version 2 and flip_prob had come with it (its default: what version 1 did)."""
    monkeypatch.setattr(method, "VERSION", 2)
    field = method_field("flip_prob")
    monkeypatch.setattr(field, "metadata", types.MappingProxyType({**field.metadata, "since": 2}))


def test_a_record_missing_a_later_field_gets_its_documented_default(flip_prob_added_in_version_2):
    old = {k: v for k, v in _record().items() if k not in ("flip_prob", "version")}
    for record in (old, {**old, "version": 1}):
        migrated = MethodRecord.from_dict(record, WHERE)
        assert migrated.flip_prob == 0.5 and migrated.to_dict()["version"] == 2
    assert "missing flip_prob" in _error({**old, "version": 2})  # a version-2 record must hold it


def test_a_step_runs_for_a_change_that_is_not_an_addition(monkeypatch):
    monkeypatch.setattr(method, "VERSION", 2)
    monkeypatch.setitem(method.STEPS, 1, lambda r: {**r, "alpha": r["alpha"] * 2})
    assert MethodRecord.from_dict(_record(alpha=3.0, version=1)).alpha == 6.0
    assert MethodRecord.from_dict(_record(alpha=3.0, version=2)).alpha == 3.0


@pytest.mark.parametrize("version, says", [
    (method.VERSION + 1, f"method record version {method.VERSION + 1} is newer than this fedmvp reads "
                         f"(up to {method.VERSION}); update fedmvp"),
    ("1", "method record version '1' is not a version"),
    (0, "method record version 0 is not a version"),
    (True, "method record version True is not a version"),
])
def test_an_unknown_version_is_refused_clearly(version, says):
    assert says in _error(_record(version=version))


def test_every_field_has_help_a_default_and_a_version():
    for f in method.method_fields():
        assert f.metadata["help"] and f.metadata["since"] >= 1 and f.default is not MISSING
        assert method.field_problem(f.name, list(f.default) if isinstance(f.default, tuple) else f.default) is None
