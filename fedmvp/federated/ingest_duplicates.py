"""One training counts once in a run: update files compared by their tensors, regions by their rounds.

A file's sha256 changes with any byte of its metadata, so the same training re-saved with another
``images_digest``, ``created`` or ``bundle_round`` was once counted again, as often as it was re-saved
(docs/security.md, "Replayed and duplicated updates"). What identifies a training is its tensors:

- **the same tensors**: an update whose LoRA equals, value for value, one accepted before in this run (or
  given in the same command) is a duplicate (``content_digest``: ``fedmvp_formats.promptformer.tensors_digest``
  of its ``lora.*`` tensors);
- **nearly the same**: one whose values differ from an accepted one's by less than ``NEAR_SHARE`` of the
  smaller of their two steps (its distance to its base, ``step_norm``) is the same training with noise
  added. Compared on a ``SKETCH_SIZE``-number sketch of each update's values (a signed hash of every value
  into ``SKETCH_SIZE`` sums: linear, so a sketch's distance estimates the values' distance), kept in
  state.json with the file's record, so no earlier update's tensors need keeping. Two honest trainings
  differ by about their steps' size, a hundred times ``NEAR_SHARE``;
- **a region's rounds**: a region file (``region_run_id``, ``region_rounds``) whose rounds overlap those of a
  file of the same region accepted before is refused: a region's progress enters the central run once.

Within one command, of the files that are the same training (or overlap in one region) one is kept:
the newest (``created``), then the lowest sha256, so the outcome never depends on argument order.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from fedmvp_formats.names import LORA_PREFIX
from fedmvp_formats.promptformer import tensors_digest

SKETCH_SIZE = 64
NEAR_SHARE = 0.01  # a distance below this share of the smaller step: the same training, noise added
RECORD_KEYS = ("content_digest", "sketch", "step_norm")  # what a file's record keeps for later comparisons


def _hashing(name: str, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(bucket, sign) of each of a tensor's ``size`` values: drawn from a generator seeded by its name, so
    every ingest of every run hashes a value to the same place."""
    seed = int.from_bytes(hashlib.sha256(b"fedmvp-sketch-1\0" + name.encode()).digest()[:8], "little")
    rng = np.random.default_rng(seed)
    return rng.integers(0, SKETCH_SIZE, size), rng.choice(np.array([-1.0, 1.0]), size)


def sketch(arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """The ``SKETCH_SIZE`` signed sums of the ``lora.*`` values (float64)."""
    out = np.zeros(SKETCH_SIZE)
    for name in sorted(k for k in arrays if k.startswith(LORA_PREFIX)):
        values = np.asarray(arrays[name], dtype=np.float64).ravel()
        buckets, signs = _hashing(name, values.size)
        out += np.bincount(buckets, weights=values * signs, minlength=SKETCH_SIZE)
    return out


def content_record(arrays: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """What state.json keeps of an accepted file to know its training again: its tensors' digest, the
    sketch of its values and its step (L2 distance to the base it is a delta against)."""
    step = math.sqrt(sum(float(np.sum((np.asarray(arrays[k], np.float64) - np.asarray(base[k], np.float64)) ** 2))
                         for k in arrays))
    return {"content_digest": tensors_digest(arrays, LORA_PREFIX),
            "sketch": [float(x) for x in sketch(arrays)], "step_norm": step}


def region_overlap(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two region files' records name one region (``region_run_id``) and overlapping rounds."""
    region = a.get("region_run_id")
    if not region or region != b.get("region_run_id"):
        return False
    try:
        (a0, a1), (b0, b1) = a["region_rounds"], b["region_rounds"]
        return int(a0) <= int(b1) and int(b0) <= int(a1)
    except (KeyError, TypeError, ValueError):
        return True  # a region's record without readable rounds: nothing tells the two apart


class Taken:
    """The run's accepted files, ``(round, record)``, prepared once for every candidate of an ingest: their
    sketches as one matrix, so a candidate is compared with thousands of earlier files in one step."""

    def __init__(self, records: Iterable[tuple[int, Mapping[str, Any]]]) -> None:
        self.records = list(records)
        self.digests = {r.get("content_digest"): (n, r) for n, r in self.records if r.get("content_digest")}
        sketched = [(n, r) for n, r in self.records if _sketched(r)]
        self.sketched = sketched
        self.sketches = np.array([r["sketch"] for _, r in sketched], float).reshape(len(sketched), SKETCH_SIZE)
        self.steps = np.array([float(r["step_norm"]) for _, r in sketched], float)
        self.regions = [(n, r) for n, r in self.records if r.get("region_run_id")]

    def why_again(self, candidate: Mapping[str, Any]) -> str | None:
        """Why ``candidate`` (`content_record` and region keys) repeats one of these files, or None."""
        match = self.digests.get(candidate.get("content_digest"))
        if match is None and _sketched(candidate) and len(self.sketched):
            distances = np.linalg.norm(self.sketches - np.asarray(candidate["sketch"], float), axis=1)
            near = np.flatnonzero(distances <= NEAR_SHARE * np.minimum(self.steps, float(candidate["step_norm"])))
            match = self.sketched[int(near[0])] if near.size else None
        if match is not None:
            return f"duplicate: the same training as {match[1].get('file')}, accepted in round {match[0]}"
        for number, record in self.regions:
            if region_overlap(candidate, record):
                return (f"region rounds {candidate.get('region_rounds')} of region run "
                        f"{candidate.get('region_run_id')} overlap rounds {record.get('region_rounds')} accepted in "
                        f"round {number} ({record.get('file')}): a region's progress enters once (start the region "
                        f"again from this run's last round)")
        return None


def _sketched(record: Mapping[str, Any]) -> bool:
    """Whether a record carries a usable sketch and step (a record from before them: only its sha256 compares)."""
    sketch, step = record.get("sketch"), record.get("step_norm")
    return isinstance(sketch, list) and len(sketch) == SKETCH_SIZE and isinstance(step, (int, float)) \
        and all(isinstance(x, (int, float)) for x in sketch)


def keep_one(records: list[dict[str, Any]]) -> dict[int, str]:
    """Of the records given in one command, {index: why it is dropped} for every one that is the same
    training as (or overlaps the region of) one kept: the newest is kept, then the lowest sha256."""
    order = sorted(range(len(records)), key=lambda i: records[i].get("sha256") or "")
    order = sorted(order, key=lambda i: records[i].get("created") or "", reverse=True)  # stable: newest first
    usable = [i for i in range(len(records)) if _sketched(records[i])]
    sketches = np.zeros((len(records), SKETCH_SIZE))
    steps = np.full(len(records), -1.0)  # a record without a sketch is near nothing
    if usable:
        sketches[usable] = np.array([records[i]["sketch"] for i in usable], float)
        steps[usable] = [float(records[i]["step_norm"]) for i in usable]
    kept: list[int] = []
    dropped: dict[int, str] = {}
    for i in order:
        twin = _twin(records, i, kept, sketches, steps)
        if twin is None:
            kept.append(i)
            continue
        what = "overlaps the region rounds of" if region_overlap(records[i], records[twin]) else \
            "is the same training as"
        dropped[i] = f"{what} {records[twin].get('file')} in this command, which is kept (newer): it counts once"
    return dropped


def _twin(records: list[dict[str, Any]], i: int, kept: list[int], sketches: np.ndarray,
          steps: np.ndarray) -> int | None:
    """The first of ``kept`` that record ``i`` repeats (equal tensors, near sketch, one region's rounds), or None."""
    if not kept:
        return None
    digest = records[i].get("content_digest")
    for k in kept:
        if digest and records[k].get("content_digest") == digest or region_overlap(records[i], records[k]):
            return k
    if steps[i] < 0:
        return None
    index = np.array(kept)
    distances = np.linalg.norm(sketches[index] - sketches[i], axis=1)
    near = np.flatnonzero((steps[index] >= 0) & (distances <= NEAR_SHARE * np.minimum(steps[index], steps[i])))
    return int(index[near[0]]) if near.size else None
