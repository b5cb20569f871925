"""Class partitions (pure, table-driven on class counts), k-shot and Dirichlet determinism."""

from __future__ import annotations

import random

import pytest

from fedmvp.data.partitions import contiguous_clients, groups_from_names, split_base_new, uncovered
from fedmvp.data.sampling import dirichlet_label_skew, holdout_split, k_shot

# docs/method.md §6: (dataset, classes, clients of 20 base classes)
BASE_TO_NEW = [
    ("Caltech101", 100, 2), ("OxfordFlowers", 102, 3), ("FGVCAircraft", 100, 2), ("UCF101", 101, 3),
    ("OxfordPets", 37, 1), ("Food101", 101, 3), ("DTD", 47, 1), ("StanfordCars", 196, 5),
    ("SUN397", 397, 10),
]


@pytest.mark.parametrize("name, classes, expected", BASE_TO_NEW)
def test_base_to_new_clients_per_dataset(name, classes, expected):
    base, new = split_base_new(classes)
    assert len(base) == -(-classes // 2) and base + new == list(range(classes))
    clients = contiguous_clients(base, 20)
    assert len(clients) == expected
    assert [y for c in clients for y in c] == base  # contiguous, disjoint, covering, in order
    assert all(len(c) >= 11 for c in clients) and all(len(c) == 20 for c in clients[:-1])


def test_base_to_new_is_thirty_clients():
    assert sum(len(contiguous_clients(split_base_new(c)[0], 20)) for _, c, _ in BASE_TO_NEW) == 30


def test_ssmt_imagenet_is_200_clients_of_5():
    clients = contiguous_clients(range(1000), 5)
    assert len(clients) == 200 and {len(c) for c in clients} == {5} and not uncovered(range(1000), clients)


@pytest.mark.parametrize("classes, base, new, expected", [
    (10, None, None, (5, 5)), (11, None, None, (6, 5)), (10, 4, None, (4, 6)), (10, 4, 2, (4, 2)),
])
def test_split_base_new_counts(classes, base, new, expected):
    b, n = split_base_new(classes, base, new)
    assert (len(b), len(n)) == expected and b == list(range(len(b))) and n[:1] == [len(b)][:len(n)]


@pytest.mark.parametrize("classes, base, new", [(10, 11, None), (10, 0, None), (10, 6, 5)])
def test_split_base_new_rejects_impossible_counts(classes, base, new):
    with pytest.raises(ValueError):
        split_base_new(classes, base, new)


def test_num_clients_leaves_classes_uncovered_or_fails():
    groups = contiguous_clients(range(10), 3, num_clients=2)
    assert groups == [[0, 1, 2], [3, 4, 5]] and uncovered(range(10), groups) == [6, 7, 8, 9]
    with pytest.raises(ValueError, match="need 15 classes"):
        contiguous_clients(range(10), 3, num_clients=5)


@pytest.mark.parametrize("clients, message", [
    ([["a"], ["zz"]], "unknown classes: zz"), ([["a", "b"], ["b"]], "more than one client: b"),
    ([["a"], []], "without classes: 1"),
])
def test_explicit_client_lists_are_checked(clients, message):
    with pytest.raises(ValueError, match=message):
        groups_from_names(clients, ["a", "b", "c"])
    assert groups_from_names([["c", "a"]], ["a", "b", "c"]) == [[2, 0]]


def _samples(classes: int, per_class: int) -> list[tuple[str, int]]:
    return [(f"/d/c{y}/{i:03d}.png", y) for y in range(classes) for i in range(per_class)]


def test_k_shot_is_deterministic_and_order_independent():
    samples = _samples(5, 20)
    shuffled = samples[:]
    random.Random(1).shuffle(shuffled)
    picked = k_shot(samples, 8, seed=7)
    assert picked == k_shot(shuffled, 8, seed=7)
    assert picked != k_shot(samples, 8, seed=8)
    assert [y for _, y in picked] == [y for y in range(5) for _ in range(8)]
    assert len(set(picked)) == 40 and set(picked) <= set(samples)
    # a class's shots do not depend on which other classes are present
    only_two = [s for s in samples if s[1] == 2]
    assert [s for s in picked if s[1] == 2] == k_shot(only_two, 8, seed=7)


def test_k_shot_keeps_all_of_a_small_class():
    samples = _samples(2, 10) + [("/d/c9/only.png", 9)]
    picked = k_shot(samples, 8, seed=0)
    assert ("/d/c9/only.png", 9) in picked and len(picked) == 17


def test_dirichlet_is_deterministic_and_a_partition():
    samples = _samples(10, 8)
    shares = dirichlet_label_skew(samples, 4, alpha=0.5, seed=3)
    assert shares == dirichlet_label_skew(list(reversed(samples)), 4, alpha=0.5, seed=3)
    assert shares != dirichlet_label_skew(samples, 4, alpha=0.5, seed=4)
    flat = [s for share in shares for s in share]
    assert sorted(flat) == sorted(samples) and all(shares)


def test_dirichlet_alpha_controls_skew():
    samples = _samples(20, 40)

    def mean_classes(alpha: float) -> float:
        shares = dirichlet_label_skew(samples, 5, alpha=alpha, seed=0)
        return sum(len({y for _, y in s}) for s in shares) / 5

    assert mean_classes(0.05) < mean_classes(100.0) == 20


def test_dirichlet_rejects_impossible_requests():
    with pytest.raises(ValueError):
        dirichlet_label_skew(_samples(1, 2), 3, alpha=1.0, seed=0)
    with pytest.raises(ValueError):
        dirichlet_label_skew(_samples(2, 2), 2, alpha=0.0, seed=0)


def test_holdout_split_is_per_class_and_deterministic():
    samples = _samples(3, 10)
    rest, held = holdout_split(samples, 0.2, seed=0)
    assert (rest, held) == holdout_split(list(reversed(samples)), 0.2, seed=0)
    assert len(held) == 6 and sorted(rest + held) == sorted(samples)
    assert sorted({y for _, y in held}) == [0, 1, 2]
