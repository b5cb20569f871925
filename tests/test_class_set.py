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


# ---- the phrases travel too: a site may take the run's class set from the server ----------------------------
def test_the_digest_is_the_same_function_of_the_same_content_with_the_phrases_in_the_record():
    # the digest of RUN before the phrases travelled: a run made then keeps its digest
    assert class_set_digest(RUN) == "eb9206a8f38da40c89950d89a481786d78ee21c248f46ee8c1724f4a729d226a"
    record = ClassSet.of(RUN).record()
    assert record["texts"] == ["whiskers", "fur", "tail", "feathers"] and record["counts"] == [2, 1, 1]
    got = read_class_set(record, with_texts=True)
    assert got == ClassSet.of(RUN) and got.digest == record["digest"] == class_set_digest(RUN)
    assert got.texts == (("whiskers", "fur"), ("tail",), ("feathers",)) and got.short == got.digest[:12]
    sent = read_instruction(Instruction(round=1, run_id="r", class_set=record).records()).class_set
    assert read_class_set(sent, with_texts=True).texts == got.texts  # through the message schema's reader
    older = {k: v for k, v in record.items() if k not in ("texts", "counts")}  # an older server's record
    assert read_class_set(older) == got and read_class_set(older).texts is None
    with pytest.raises(ValueError, match="carries no attribute phrases"):
        read_class_set(older, with_texts=True)


def _hostile(**changes) -> dict:
    return {**ClassSet.of(RUN).record(), **changes}


FAR_TOO_MANY = ["x" * 1000] * 1000  # 1000 phrases of 1000 characters, 9 classes of them: past 8 MiB


@pytest.mark.parametrize("record, why", [
    (_hostile(digest="0" * 64), "digest is not the digest of its classes"),
    (_hostile(texts=["whiskers", "fur", "tail", "scales"]), "phrases of class owl are not the ones its digest names"),
    (_hostile(texts=["fur", "whiskers", "tail", "feathers"]), "phrases of class cat are not the ones"),
    (_hostile(counts=[1, 2, 1]), "phrases of class cat are not the ones"),
    ({k: v for k, v in _hostile().items() if k != "texts"}, "carries no attribute phrases"),
    ({k: v for k, v in _hostile().items() if k != "counts"}, "carries no attribute phrases"),
    ({k: v for k, v in _hostile().items() if k != "phrases"}, "not one sha256 per class"),
    (_hostile(counts=[10 ** 12, 1, 1]), "not one count of 0 to 1000 phrases per class"),
    (_hostile(counts=[2, 1]), "not one count"),
    (_hostile(counts=[2, True, 1]), "not one count"),
    (_hostile(counts=[2, -1, 2]), "not one count"),
    (_hostile(counts="2,1,1"), "not one count"),
    (_hostile(texts=["whiskers", "fur", "tail"]), "texts are not 4 phrases"),
    (_hostile(texts=["whiskers", 7, "tail", "feathers"]), "texts are not 4 phrases"),
    (_hostile(texts=["whiskers", b"fur", "tail", "feathers"]), "texts are not 4 phrases"),
    (_hostile(texts="whiskers fur tail feathers"), "texts are not 4 phrases"),
    (_hostile(texts=["w" * 1001, "fur", "tail", "feathers"]), "at most 1000 characters"),
    (_hostile(names=["cat", 3, "owl"]), "names are not a list"),
    (_hostile(names=["c" * 1001, "dog", "owl"]), "names are not a list"),
    (_hostile(names=[f"c{i}" for i in range(100_001)]), "names are not a list"),
    ({**ClassSet.of([(f"c{i}", []) for i in range(9)]).record(), "texts": FAR_TOO_MANY * 9, "counts": [1000] * 9},
     "exceed 8388608 characters"),
    ("cat,dog,owl", "not a mapping"),
])
def test_a_hostile_class_set_record_is_refused_with_one_line(record, why):
    with pytest.raises(ValueError, match=why) as refused:
        read_class_set(record, with_texts=True)
    assert "\n" not in str(refused.value) and len(str(refused.value)) < 300
