"""One training, sent again as an outsider would: `fedmvp ingest` counts it once, from the base it really has.

Rows (docs/security.md "Replayed and duplicated updates"):
- after an ingest round (which keeps the PromptFormer), a file re-saved with ``bundle_round`` raised by one
  is refused (its ``base_digest`` is round 2's state), and so is one whose digest was forged to round 3's:
  its tensors were taken in round 3 already;
- the same training re-saved six times with other metadata (``images_digest``, none, ``created``) counts
  once; with noise far below its step it is still the same training; an honest second training counts;
- a region file sent twice, in one command or two, enters the central run once.
The run is tests/run_fixtures.py's (rounds 1 and 2, tiny CLIP); ingest runs in process.
"""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from fedmvp.federated.ingest import ingest
from fedmvp.runs import RunDir
from tests.federated.test_ingest import base_run, good_update, lora_of, round_promptformer, round_state  # noqa: F401
from tests.federated.test_ingest import run  # noqa: F401


def resaved(source, target, noise: float = 0.0, **meta: str | None):
    """``source``'s tensors (plus uniform noise of at most ``noise``) with its metadata changed by ``meta``
    (None drops a key): what anyone holding an update file can write."""
    tensors = load_file(str(source))
    from safetensors import safe_open

    with safe_open(str(source), "np") as handle:
        metadata = dict(handle.metadata())
    rng = np.random.default_rng(len(str(target)))
    tensors = {k: (v + rng.uniform(-noise, noise, v.shape)).astype(np.float32) for k, v in tensors.items()}
    for key, value in meta.items():
        metadata.pop(key, None) if value is None else metadata.__setitem__(key, value)
    save_file(tensors, str(target), metadata=metadata)
    return target


def test_a_replay_into_the_next_round_is_refused_whatever_round_it_claims(run, tmp_path):
    from tests.federated.test_ingest import configure

    configure(run, {"max_staleness": 5, "edge_max_examples": 100})  # round 2 is within reach: not merely stale
    honest = good_update(tmp_path / "a.st", lora_of(run), 0.01, 10, 1.0)
    assert ingest(run, [honest]).round == 3  # an ingest round: the PromptFormer is round 2's, the LoRA moved
    assert round_promptformer(run, 3) == round_promptformer(run, 2) and round_state(run, 3) != round_state(run, 2)

    bumped = resaved(honest, tmp_path / "bumped.st", bundle_round="3", created="2030-01-01T00:00:00Z")
    result = ingest(run, [bumped])
    assert result.round is None and "bundle_round 3, but its base_digest is round 2's state" in result.files[0].reason
    unknown = resaved(honest, tmp_path / "unknown.st", base_digest="e" * 64, created="2030-01-01T00:00:02Z")
    assert "is the state of none of this run's rounds 0-3" in ingest(run, [unknown]).files[0].reason

    forged = resaved(honest, tmp_path / "forged.st", bundle_round="3", base_digest=round_state(run, 3),
                     created="2030-01-01T00:00:01Z")
    result = ingest(run, [forged])
    assert result.round is None and "duplicate: the same training as" in result.files[0].reason
    assert "accepted in round 3" in result.files[0].reason and RunDir(run).rounds() == [1, 2, 3]


def test_the_same_training_resaved_counts_once_and_noise_does_not_make_it_new(run, tmp_path):
    honest = good_update(tmp_path / "a.st", lora_of(run), 0.01, 10, 1.0, images_digest="1" * 64)
    copies = [resaved(honest, tmp_path / f"copy{i}.st", images_digest=digest, created=f"2030-01-0{i + 1}T00:00:00Z")
              for i, digest in enumerate(["2" * 64, "3" * 64, None, "4" * 64, "5" * 64])]
    noisy = resaved(honest, tmp_path / "noisy.st", noise=1e-6, images_digest="6" * 64)
    other = good_update(tmp_path / "b.st", lora_of(run), -0.02, 30, 0.5)  # another training
    result = ingest(run, [honest, *copies, noisy, other])
    assert result.round == 3 and result.examples == 40, [v.reason for v in result.files]
    assert sorted(v.file for v in result.accepted) == sorted([str(copies[-1]), str(other)])  # the newest copy
    assert all("is the same training as" in v.reason for v in result.rejected), [v.reason for v in result.rejected]
    record = RunDir(run).round_state(3)["ingest"]
    assert all(len(r["sketch"]) == 64 and r["step_norm"] > 0 for r in record if r["accepted"])


def test_a_region_file_enters_once(tmp_path):
    import shutil

    from fedmvp.federated.regions import region_start, region_update
    from tests.federated.test_ingest import configure
    from tests.federated.test_regions import device_file
    from tests.run_fixtures import write_run

    write_run(tmp_path / "central", tmp_path / "preset.toml", "", "regionreplay", moved=True)
    from fedmvp.attributes.sentences import SentenceStyle
    from fedmvp.run_classes import RunClass, write_classes

    write_classes(tmp_path / "central", [RunClass("x", ("a photo",), SentenceStyle(prefix="", suffix=""))])
    configure(tmp_path / "central", {"edge_max_examples": 100, "max_staleness": 5})
    region = tmp_path / "region"
    region_start(tmp_path / "central", region)
    ingest(region, [device_file(region, tmp_path, "d1", 0.01, 20)])
    first = region_update(region, tmp_path / "r1.st").file
    again = region_update(region, tmp_path / "r2.st").file  # the same region rounds, written again
    shutil.copytree(tmp_path / "central", tmp_path / "copy")

    both = ingest(tmp_path / "copy", [first, again])  # in one command: one of the two
    assert both.round == 3 and len(both.accepted) == 1
    assert "overlaps the region rounds of" in both.rejected[0].reason or "same training" in both.rejected[0].reason

    assert ingest(tmp_path / "central", [first]).round == 3
    ingest(region, [device_file(region, tmp_path, "d2", 0.02, 20)])  # the region went on: rounds 3-4 now
    later = region_update(region, tmp_path / "r3.st").file
    result = ingest(tmp_path / "central", [later])
    assert result.round is None and "overlap rounds [3, 3] accepted in round 3" in result.files[0].reason
