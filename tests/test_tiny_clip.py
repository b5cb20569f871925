"""The shipped tiny CLIP: loads offline by name, reproduces its recorded zero-shot figures, and the
pretraining command runs end to end (a few steps only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedmvp.clip import load_clip, shipped_weights
from fedmvp.synthetic.writer import ensure_world

RECORD = Path(__file__).resolve().parents[1] / "fedmvp" / "weights" / "fedmvp-tiny-synthetic.zero-shot.json"
MARGIN = 3.0  # percentage points


@pytest.fixture(scope="module")
def record() -> dict:
    return json.loads(RECORD.read_text())


@pytest.fixture(scope="module")
def test_world(tmp_path_factory, record) -> Path:
    """The recorded world's test split only: same bytes as the default world's (per-image seeds)."""
    world = record["world"]
    counts = {record["split"]: world["splits"][record["split"]]}
    root = tmp_path_factory.getbasetemp() / f"world-{world['seed']}-{record['split']}"
    return ensure_world(root, seed=world["seed"], counts=counts)


@pytest.fixture(scope="module")
def shipped():
    return load_clip("fedmvp-tiny", "synthetic")


def test_shipped_weights_load_offline_by_name(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = shipped_weights("fedmvp-tiny", "synthetic")
    assert path is not None and path.is_file() and path.stat().st_size < 5_000_000
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}
    clip = load_clip("fedmvp-tiny", "synthetic")
    assert clip.identity.startswith("fedmvp-tiny:synthetic:sha256:")  # keyed by the bytes, not just the tag
    assert clip.image_size == 32 and clip.embed_dim == 128
    assert not any(p.requires_grad for p in clip.model.parameters())
    assert 1.5e6 < sum(p.numel() for p in clip.model.parameters()) < 2.0e6


def test_zero_shot_figures_match_the_record(shipped, test_world: Path, record: dict) -> None:
    from fedmvp.synthetic.zero_shot import world_zero_shot

    report = world_zero_shot(shipped, test_world, split=record["split"])
    for domain, groups in record["results"].items():
        for group, expected in groups.items():
            got = report["results"][domain][group]
            assert got["images"] == expected["images"] and got["chance"] == expected["chance"]
            for prompt in ("name", "attributes"):
                assert abs(got[prompt] - expected[prompt]) <= MARGIN, (
                    f"{domain}/{group}/{prompt}: {got[prompt]:.1f} vs recorded {expected[prompt]:.1f} "
                    f"(weights or world drifted; re-measure with benchmarks/zero_shot_tiny.py --record)")


def test_recorded_figures_tell_the_story(record: dict) -> None:
    """Clearly above chance, clearly below 100 (room for prompt tuning); attributes carry held-out classes."""
    photo = record["results"]["photo"]
    for group in ("seen", "held_out"):
        r = photo[group]
        assert r["chance"] + 10 < r["attributes"] < 90
    assert photo["held_out"]["attributes"] > photo["held_out"]["name"] + 10
    for domain in record["results"].values():
        for r in domain.values():
            assert r["attributes"] > 2 * r["chance"]


def test_pretrain_tiny_smoke(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from fedmvp_apps.cli import main

    out = tmp_path / "tiny.safetensors"
    vocab = Path(__file__).resolve().parents[1] / "fedmvp/model_configs/fedmvp-tiny-vocab.json"
    before = vocab.read_bytes()
    result = CliRunner().invoke(main, ["pretrain-tiny", "--steps", "3", "--batch-size", "8", "--warmup", "1",
                                       "--workers", "0", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["steps"] == 3 and Path(summary["out"]) == out and out.is_file()
    assert vocab.read_bytes() == before  # only --write-vocab touches the vocabulary
    clip = load_clip("fedmvp-tiny", str(out))
    assert clip.identity.startswith("fedmvp-tiny:sha256:")
    assert not list(tmp_path.glob(".*.tmp"))


def test_caption_stream_never_names_held_out_classes() -> None:
    from fedmvp.synthetic.world import held_out_classes
    from fedmvp.synthetic.pretrain import PretrainConfig, render_batch, CaptionSampler

    config = PretrainConfig(batch_size=64)
    sampler = CaptionSampler(config)
    held = {c.name for c in held_out_classes()}
    batch = render_batch(0, config, sampler)
    words = {w.strip(",") for text in batch["captions"] for w in text.split()}
    assert not words & held
    assert batch["match"].diagonal().all() and batch["images"].shape == (64, 3, 32, 32)
