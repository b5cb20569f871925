"""The class-set digest (fedmvp_formats.class_set): one identity of a run's ordered classes and phrases,
what every message, bundle and update carries, and the one line that says what differs."""

from __future__ import annotations

import json

import pytest

from fedmvp_formats.class_set import ClassSet, class_set_digest, read_class_set
from fedmvp_formats.messages import (CLASS_SET, IDENTITY, Identity, Instruction, MessageError, read_identity,
                                     read_instruction)

RUN = [("cat", ["whiskers", "fur"]), ("dog", ["tail"]), ("owl", ["feathers"])]


@pytest.mark.parametrize("other, says", [
    ([RUN[1], RUN[0], RUN[2]], "other class order (class 0 is dog here, cat in the run)"),
    ([("cat", ["whiskers", "scales"]), *RUN[1:]], "other attribute phrases (first for class cat)"),
    ([("cat", ["fur", "whiskers"]), *RUN[1:]], "other attribute phrases (first for class cat)"),
    ([*RUN, ("fox", ["snout"])], "other classes (has class fox the run has not)"),
    (RUN[:2], "other classes (lacks the run's class owl)"),
    ([("cat", RUN[0][1]), ("dog", RUN[1][1]), ("bat", ["wings"])],
     "other classes (lacks the run's class owl; has class bat the run has not)"),
])
def test_order_phrases_and_classes_change_the_digest_and_are_named(other, says):
    run, ours = ClassSet.of(RUN), ClassSet.of(other)
    assert class_set_digest(other) != class_set_digest(RUN)
    assert ours.difference(run) == says


def test_the_same_set_has_one_digest_and_no_difference():
    assert class_set_digest(RUN) == class_set_digest([(n, tuple(p)) for n, p in RUN]) == ClassSet.of(RUN).digest
    assert ClassSet.of(RUN).difference(ClassSet.of(list(RUN))) is None
    assert len(class_set_digest(RUN)) == 64


def test_a_received_record_is_checked_before_it_is_compared():
    record = ClassSet.of(RUN).record()
    assert read_class_set(record) == ClassSet.of(RUN)
    for key, value, why in [("digest", "0" * 64, "not the digest"), ("names", ["cat", "cat", "owl"], "unique"),
                            ("phrases", ["x"] * 3, "one sha256 per class"), ("names", [], "unique")]:
        with pytest.raises(ValueError, match=why):
            read_class_set({**record, key: value})


def test_messages_carry_the_class_set_and_replies_name_theirs():
    record = ClassSet.of(RUN).record()
    sent = Instruction(round=2, run_id="r", class_set=record).records()
    assert sent[CLASS_SET] == record and len(json.dumps(record)) < 1000
    assert read_instruction(sent).class_set == record
    assert read_instruction(Instruction(round=2, run_id="r").records()).class_set is None  # a run without one
    digest = record["digest"]
    mine = Identity(round=2, run_id="r", site=0, classes_digest=digest).record()
    assert read_identity(mine, "r", 2, digest).classes_digest == digest
    other = Identity(round=2, run_id="r", site=0, classes_digest=ClassSet.of(RUN[:2]).digest).record()
    with pytest.raises(MessageError, match="reply of another class set"):
        read_identity(other, "r", 2, digest)
    edge = Identity(round=2, run_id="r", bundle_id="b" * 64, promptformer_digest="p", classes_digest="c" * 64)
    with pytest.raises(MessageError, match="another class set"):
        read_identity(edge.record(), "r", 2, digest)
    assert IDENTITY == "identity"


def test_the_run_records_its_digest_and_refuses_an_edited_record(tmp_path):
    from fedmvp.attributes.sentences import SentenceStyle
    from fedmvp.run_classes import ClassRecordError, RunClass, class_set, read_classes, write_classes

    style = SentenceStyle(prefix="a photo of a", suffix=".")
    classes = [RunClass(n, tuple(p), style) for n, p in RUN]
    path = write_classes(tmp_path, classes)
    record = json.loads(path.read_text())
    assert record["format_version"] == 2 and record["digest"] == class_set_digest(RUN) == class_set(classes).digest
    assert read_classes(tmp_path) == classes
    record["classes"][0]["phrases"] = ["edited"]
    path.write_text(json.dumps(record))
    with pytest.raises(ClassRecordError, match="digest is not the digest of its classes"):
        read_classes(tmp_path)
    old = {**record, "format_version": 1}  # a run of an older fedmvp: no digest, computed when read
    old.pop("digest")
    path.write_text(json.dumps(old))
    assert class_set(read_classes(tmp_path)).digest != class_set_digest(RUN)
