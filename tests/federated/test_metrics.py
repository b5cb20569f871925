"""combine_counts: the paper's metrics from per-site counts, and how many sites each is a mean over
(docs/method.md §7, "Evaluation where the data is"; issue 24 §3)."""

from __future__ import annotations

import pytest

from fedmvp.federated.metrics import SITE_COUNT_KEYS, combine_counts, evaluation_sites, harmonic_mean


def _site_record(names: list[str], new: bool = True) -> dict:
    """A [federation] record as federation_plan.plan_sites writes it: every site has its own base set
    and (when the class set has new classes) its own new set, whether or not it holds a new class."""
    clients = [{"id": i, "name": n, "dataset": "fed", "domain": n} for i, n in enumerate(names)]
    evaluations = [{"name": f"fed/{kind}/{n}", "kind": kind, "dataset": "fed", "domain": n}
                   for n in names for kind in (("base", "new") if new else ("base",))]
    return {"clients": clients, "evaluations": evaluations}


PAPER_RECORD = {  # two datasets (2 + 1 clients), base/new on each, one held-out domain
    "clients": [{"id": 0, "dataset": "d1", "domain": "photo"}, {"id": 1, "dataset": "d1", "domain": "photo"},
                {"id": 2, "dataset": "d2", "domain": "photo"}],
    "evaluations": [{"name": "d1/base/photo", "kind": "base", "dataset": "d1", "domain": "photo"},
                    {"name": "d1/new/photo", "kind": "new", "dataset": "d1", "domain": "photo"},
                    {"name": "d2/base/photo", "kind": "base", "dataset": "d2", "domain": "photo"},
                    {"name": "d2/new/photo", "kind": "new", "dataset": "d2", "domain": "photo"},
                    {"name": "d2/domain/sketch", "kind": "domain", "dataset": "d2", "domain": "sketch"}]}

CASES = [
    pytest.param(  # site c holds no new class: it reports no new count, and New is the mean of a and b
        _site_record(["a", "b", "c"]),
        {0: {"local": (8, 10), "fed/base/a": (6, 10), "fed/new/a": (3, 4)},
         1: {"local": (9, 10), "fed/base/b": (7, 10), "fed/new/b": (1, 4)},
         2: {"local": (10, 10), "fed/base/c": (5, 10)}},
        {"local": 0.9, "base": 0.6, "new": 0.5, "domain": None},
        {"local_sites": 3, "base_sites": 3, "new_sites": 2, "domain_sites": 0, "hm_sites": 3},
        id="a site without new classes adds nothing to New"),
    pytest.param(  # a zero total (a set with no image) is no contribution either, never a 0 %
        _site_record(["a", "b"]),
        {0: {"local": (1, 2), "fed/base/a": (1, 2), "fed/new/a": (0, 0)},
         1: {"local": (1, 2), "fed/base/b": (1, 4), "fed/new/b": (2, 4)}},
        {"local": 0.5, "base": 0.375, "new": 0.5, "domain": None},
        {"local_sites": 2, "base_sites": 2, "new_sites": 1, "domain_sites": 0, "hm_sites": 2},
        id="a zero total is left out"),
    pytest.param(  # no new class anywhere: New is None, HM of Local and Base over the sites holding them
        _site_record(["a", "b"], new=False),
        {0: {"local": (3, 4), "fed/base/a": (1, 2)}, 1: {"local": (1, 4), "fed/base/b": (1, 2)}},
        {"local": 0.5, "base": 0.5, "new": None, "domain": None},
        {"local_sites": 2, "base_sites": 2, "new_sites": 0, "domain_sites": 0, "hm_sites": 2},
        id="no new classes"),
    pytest.param(  # a site that did not answer: only Local of the others, its sets left out
        _site_record(["a", "b"]),
        {0: {"local": (3, 4), "fed/base/a": (1, 2), "fed/new/a": (1, 4)}},
        {"local": 0.75, "base": 0.5, "new": 0.25, "domain": None},
        {"local_sites": 1, "base_sites": 1, "new_sites": 1, "domain_sites": 0, "hm_sites": 1},
        id="a missing site"),
    pytest.param(  # the paper's datasets: Local is a mean over a dataset's clients, then over datasets
        PAPER_RECORD,
        {0: {"local": (1, 2), "d1/base/photo": (3, 4), "d1/new/photo": (1, 2)},
         1: {"local": (1, 1)},
         2: {"local": (1, 4), "d2/base/photo": (1, 4), "d2/new/photo": (1, 2), "d2/domain/sketch": (2, 5)}},
        {"local": (0.75 + 0.25) / 2, "base": 0.5, "new": 0.5, "domain": 0.4},
        {"local_sites": 3, "base_sites": 2, "new_sites": 2, "domain_sites": 1, "hm_sites": 3},
        id="paper datasets"),
    pytest.param(  # HM's sites: those that contributed to any of Local, Base, New (not Domain)
        PAPER_RECORD,
        {0: {"local": (1, 2)}, 2: {"d2/domain/sketch": (2, 5)}},
        {"local": 0.5, "base": None, "new": None, "domain": 0.4},
        {"local_sites": 1, "base_sites": 0, "new_sites": 0, "domain_sites": 1, "hm_sites": 1},
        id="hm sites leave out domain-only sites"),
]


@pytest.mark.parametrize("record, counts, means, sites", CASES)
def test_combine_counts_means_and_contributors(record, counts, means, sites):
    metrics = combine_counts(record, counts)
    for key, value in means.items():
        assert metrics[key] == (pytest.approx(value) if value is not None else None), key
    parts = [means[k] for k in ("local", "base", "new") if means[k] is not None]
    assert metrics["hm"] == pytest.approx(harmonic_mean(parts))
    assert {k: metrics[k] for k in SITE_COUNT_KEYS} == sites


def test_a_federation_site_evaluates_its_own_sets():
    """Each [federation] site's base and new sets are its own (their domain is its name)."""
    record = _site_record(["a", "b", "c"])
    assert evaluation_sites(record) == {f"fed/{kind}/{n}": i for i, n in enumerate("abc") for kind in ("base", "new")}


def test_the_metric_keys_are_unchanged_with_the_counts_added():
    """The paper's metrics keep their keys and values; the site counts are additions only."""
    metrics = combine_counts(PAPER_RECORD, {0: {"local": (1, 2)}})
    assert list(metrics) == ["local", "base", "new", "domain", "hm", *SITE_COUNT_KEYS]


@pytest.mark.parametrize("raw, counts", [
    ({"0": {"local": [1, 2]}, "1": {"fed/base/a": [0, 3]}}, {0: {"local": (1, 2)}, 1: {"fed/base/a": (0, 3)}}),
    ({"0": {"local": [3, 2]}}, None),  # more correct than total
    ({"0": {"local": [-1, 2]}}, None),
    ({"x": {"local": [1, 2]}}, None),
    ({"0": ["local"]}, None),
    ("counts", None),
])
def test_recorded_site_counts_are_read_back_only_when_they_make_sense(raw, counts):
    """What an evaluation recorded (metrics.counted) pairs two rows later; a row edited by hand never does."""
    from fedmvp.federated.metrics import recorded_counts

    assert recorded_counts({"site_counts": raw}) == counts
