"""The lines under a table (fedmvp.federated.populations): what each row is over, and a column over one
class flagged (a 1-way choice reads 100% whatever the model: the real-photo tutorial's one held-out
class showed New 100.00 bare)."""

from __future__ import annotations

import pytest

from fedmvp.federated.populations import population_lines


def _columns(new_classes: int) -> dict:
    return {"local": {"sites": 2, "classes": 6, "images": 36}, "base": {"sites": 2, "classes": 6, "images": 36},
            "new": {"sites": 2, "classes": new_classes, "images": 24}}


@pytest.mark.parametrize("new_classes,flagged", [(1, True), (2, False)])
def test_a_column_over_one_class_is_flagged(new_classes, flagged):
    columns = _columns(new_classes)
    lines = population_lines({"population": {"zero-shot": columns, "tuned": columns}})
    assert lines[0] == (f"both rows over: Local 2 sites, 6 classes, 36 images; Base 2 sites, 6 classes, 36 images; "
                        f"New 2 sites, {new_classes} class{'es' if new_classes > 1 else ''}, 24 images")
    warnings = [line for line in lines if line.startswith("warning: New is over 1 class: a 1-way choice, 100% whatever the model (HM with it); ")]
    assert len(warnings) == (1 if flagged else 0) and len(lines) == 1 + len(warnings)
