"""Attribute files, class lists, the prompt contract and offline templates (no network)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fedmvp.attributes import prompt
from fedmvp.attributes.files import (META_KEY, AttributeFileError, load_attributes,
                                     read_attribute_file, read_class_names, save_attributes)
from fedmvp.attributes.generate import offline_attributes, parse_retry_after

GIRAFFE = ["exceptionally long neck", "brown patches on yellow fur", "ossicones on the head",
           "long thin legs", "short mane", "tufted tail", "large dark eyes", "long tongue",
           "sloping back", "towering height"]
ZEBRA = [f"zebra phrase {i}" for i in range(10)]


def _paper_file(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "paper.json"
    path.write_text(json.dumps(data))
    return path


def test_paper_file_loads_as_is_in_requested_order(tmp_path: Path) -> None:
    path = _paper_file(tmp_path, {"zebra": ZEBRA, "giraffe": GIRAFFE})
    attrs = load_attributes(path, ["giraffe", "zebra"])
    assert list(attrs) == ["giraffe", "zebra"]
    assert attrs["giraffe"] == GIRAFFE and attrs["zebra"] == ZEBRA
    assert list(load_attributes(path)) == ["zebra", "giraffe"]  # file order without a list


def test_k_truncates_and_none_keeps_all(tmp_path: Path) -> None:
    path = _paper_file(tmp_path, {"giraffe": GIRAFFE + ["extra one", "extra two"]})
    assert load_attributes(path, k=10)["giraffe"] == GIRAFFE
    assert len(load_attributes(path, k=None)["giraffe"]) == 12
    with pytest.raises(AttributeFileError, match=r"fewer than 13 phrases: giraffe \(12\)"):
        load_attributes(path, k=13)


def test_missing_classes_are_listed_in_one_error(tmp_path: Path) -> None:
    path = _paper_file(tmp_path, {"giraffe": GIRAFFE, "Red_Circle": ZEBRA})
    with pytest.raises(AttributeFileError) as info:
        load_attributes(path, ["giraffe", "zebra", "okapi", "red circle"])
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert str(path) in message
    assert "3 of 4 classes missing: zebra, okapi, red circle" in message
    assert "'red circle' (file has 'Red_Circle')" in message  # hint, but no fuzzy match
    assert "\n" not in message


def test_meta_block_is_ignored_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "gen.json"
    meta = {"model": "gpt-4o", "prompt_version": prompt.PROMPT_VERSION, "created": "2025-01-01"}
    save_attributes(path, {"giraffe": GIRAFFE, "zebra": ZEBRA}, meta)
    raw = json.loads(path.read_text())
    assert list(raw)[0] == META_KEY and raw[META_KEY]["model"] == "gpt-4o"
    assert list(load_attributes(path)) == ["giraffe", "zebra"]
    attrs, read_meta = read_attribute_file(path)
    assert read_meta == meta and attrs["zebra"] == ZEBRA
    assert [p.name for p in path.parent.iterdir()] == ["gen.json"]  # no temp files left


def test_save_is_atomic_when_the_replace_fails(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "gen.json"
    save_attributes(path, {"giraffe": GIRAFFE}, {"model": "a"})
    before = path.read_text()

    def boom(src, dst):  # the rename is the commit point: fail right there
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        save_attributes(path, {"giraffe": ZEBRA}, {"model": "b"})
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["gen.json"]


def test_meta_key_cannot_be_a_class(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="reserved"):
        save_attributes(tmp_path / "x.json", {META_KEY: GIRAFFE}, {})


@pytest.mark.parametrize("text, expected", [
    ('{"giraffe": ["a", ', r"not valid JSON \(line 1, column \d+"),
    ('["giraffe"]', r"expected a JSON object \{class: \[phrases\]\}, got a list"),
    ('{"giraffe": "long neck", "zebra": [1, 2]}', r"2 classes do not map to a list of strings: giraffe, zebra"),
    ('{"_meta": [1], "giraffe": []}', r"'_meta' must be an object"),
])
def test_bad_files_give_one_line_naming_the_file(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(AttributeFileError, match=expected) as info:
        load_attributes(path)
    assert str(info.value).startswith(str(path)) and "\n" not in str(info.value)


def test_absent_file_and_empty_phrases(tmp_path: Path) -> None:
    with pytest.raises(AttributeFileError, match="no such attribute file"):
        load_attributes(tmp_path / "nope.json")
    path = _paper_file(tmp_path, {"giraffe": GIRAFFE[:9] + ["  "]})
    with pytest.raises(AttributeFileError, match="empty phrases for classes: giraffe"):
        load_attributes(path)


def test_class_lists_text_and_json(tmp_path: Path) -> None:
    text = tmp_path / "classes.txt"
    text.write_text("# animals\ngiraffe\n\n  zebra  \nred_circle\n")
    assert read_class_names(text) == ["giraffe", "zebra", "red_circle"]
    js = tmp_path / "classes.json"
    js.write_text('["giraffe", "zebra"]')
    assert read_class_names(js) == ["giraffe", "zebra"]
    dup = tmp_path / "dup.txt"
    dup.write_text("zebra\ngiraffe\nzebra\n")
    with pytest.raises(AttributeFileError, match="duplicate class names: zebra"):
        read_class_names(dup)
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n\n")
    with pytest.raises(AttributeFileError, match="no class names"):
        read_class_names(empty)


def test_prompt_is_versioned_and_carries_domain_hint() -> None:
    assert prompt.PROMPT_VERSION.startswith("fedmvp-attributes-v")
    plain = prompt.build_messages("red_circle", 7)
    assert [m["role"] for m in plain] == ["system", "user"]
    assert '"red circle"' in plain[1]["content"] and "exactly 7" in plain[1]["content"]
    assert "depicted" not in plain[1]["content"]
    hinted = prompt.build_messages("giraffe", 10, domain="art_painting")
    assert "depicted as art painting" in hinted[1]["content"]
    fmt = prompt.response_format(7)
    schema = fmt["json_schema"]["schema"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    assert schema["properties"]["attributes"]["minItems"] == 7
    assert schema["required"] == ["attributes"] and schema["additionalProperties"] is False


def test_parse_answer_cleans_and_rejects() -> None:
    answer = json.dumps({"attributes": [f" phrase {i}. " for i in range(3)]})
    assert prompt.parse_answer(answer, 3) == ["phrase 0", "phrase 1", "phrase 2"]
    cases = {
        '{"attributes": ["a", "b"]}': "expected 3 phrases, got 2",
        '{"attributes": ["a", "A ", "b"]}': "duplicate phrase 'A'",
        '{"attributes": ["a", "", "b"]}': "phrase 2 is empty",
        json.dumps({"attributes": ["a", "b", "x" * 200]}): "phrase 3 is too long",
        '{"attributes": ["a", "b"': "not valid JSON",
        '{"phrases": ["a", "b", "c"]}': 'not {"attributes": [strings]}',
        "": "empty",
    }
    for content, reason in cases.items():
        with pytest.raises(prompt.InvalidAnswer) as info:
            prompt.parse_answer(content, 3)
        assert reason in str(info.value), (content, str(info.value))


def test_offline_templates_are_valid_phrases() -> None:
    phrases = offline_attributes("apple_pie", 12)
    assert len(phrases) == 12 and len(set(phrases)) == 12
    assert phrases[0] == "the typical shape of an apple pie"
    assert prompt.phrase_problems(phrases, 12) == []


def test_retry_after_header_forms() -> None:
    assert parse_retry_after({"retry-after": "2"}) == 2.0
    assert parse_retry_after({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    assert parse_retry_after({}) is None
    assert parse_retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0.0  # past
    assert parse_retry_after({"retry-after": "soon"}) is None
