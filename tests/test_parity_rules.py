"""The parity rules (fedmvp_formats/parity_rules.py): fp32 agrees everywhere; a reduced precision is
judged on the images fp32 itself decides, not on near ties that any rounding flips."""

from __future__ import annotations

import numpy as np
import pytest

from fedmvp_formats.parity_rules import MIN_DECISIVE, NEAR_TIE_REL, agreement, top1_margins

RANGE = 10.0


def logits(margins: list[float]) -> np.ndarray:
    """One row per image: class 0 leads class 1 by its margin; class 2 sets the range to RANGE."""
    rows = np.zeros((len(margins), 3))
    rows[:, 0] = margins
    rows[:, 2] = -RANGE
    return rows


def flipped(rows: np.ndarray, which: list[int]) -> np.ndarray:
    out = rows.copy()
    for i in which:
        out[i, 1] = out[i, 0] + 1e-3  # class 1 now just ahead
    return out


DECISIVE = 1.0  # 10% of the range
TIE = 0.5 * NEAR_TIE_REL * RANGE  # half the near-tie margin


@pytest.mark.parametrize("precision,margins,flips,passed", [
    ("bf16", [DECISIVE] * 31 + [TIE], [31], True),  # the demo's case: one coin toss flipped
    ("bf16", [DECISIVE] * 32, [0], False),  # a decisive image flipped: 31/32 < 99%
    ("bf16", [TIE] * 4 + [DECISIVE] * 28, [0, 1, 2, 3], True),  # only ties flipped
    ("bf16", [TIE] * 8, [0], False),  # nothing decisive: nothing verified (it used to pass "on the 0")
    ("bf16", [TIE] * 32, [], False),  # all near-tied and none flipped: still nothing verified
    ("bf16", [DECISIVE] * 8 + [TIE] * 24, [9], True),  # MIN_DECISIVE images decide it
    ("bf16", [DECISIVE] * 7 + [TIE] * 25, [], False),  # one short
    ("fp16", [DECISIVE] * 4, [], True),  # fewer images than MIN_DECISIVE checked: every one decides
    ("fp16", [DECISIVE] * 3 + [TIE], [], False),
    ("fp32", [DECISIVE] * 31 + [TIE], [31], False),  # fp32 agrees on every image, ties included
    ("fp32", [TIE] * 8, [], True),  # fp32 has no near-tie rule: every image is judged
    ("int8", [DECISIVE] * 200, [0], True),  # 199/200 >= 99%
    ("int8", [DECISIVE] * 200, [0, 1, 2], False),
], ids=["bf16-tie-flip", "bf16-decisive-flip", "bf16-ties-only", "bf16-all-ties", "bf16-32-ties",
        "bf16-8-decisive", "bf16-7-decisive", "fp16-4-of-4", "fp16-3-of-4", "fp32-tie-flip", "fp32-ties",
        "int8-1-in-200", "int8-3-in-200"])
def test_a_reduced_precision_is_judged_on_decisive_images(precision, margins, flips, passed):
    reference = logits(margins)
    found = agreement(reference, flipped(reference, flips), precision)
    assert found.passed is passed, found.describe()
    assert found.top1_agreement == pytest.approx(1 - len(flips) / len(margins))
    if precision != "fp32":
        assert found.decisive_images == sum(m >= NEAR_TIE_REL * RANGE for m in margins)
        assert "not near-tied" in found.describe()
        if found.decisive_images < min(MIN_DECISIVE, len(margins)):
            assert "too few decide it" in found.describe() and "not verified" in found.describe()


def test_the_logit_bound_still_holds_reduced_precisions_to_scale():
    reference = logits([DECISIVE] * 8)
    assert not agreement(reference, reference * 1.5, "bf16", bound_reduced=True).passed  # top-1 all agree
    assert agreement(reference, reference * 1.01, "bf16", bound_reduced=True).passed


def test_margins():
    assert top1_margins(np.array([[3.0, 1.0, 2.5], [0.0, 0.0, -1.0]])).tolist() == [0.5, 0.0]
    assert top1_margins(np.array([[1.0], [2.0]])).tolist() == [0.0, 0.0]
