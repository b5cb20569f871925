"""Run directories: the accuracy plot of a run that has no New classes or no held-out domain."""

from __future__ import annotations

from fedmvp.runs import RunDir


def test_plot_leaves_out_metrics_a_protocol_does_not_have(tmp_path):
    run = RunDir(tmp_path)
    run.write_json("zero_shot.json", {"local": 0.5, "base": 0.4, "new": None, "hm": 0.45, "domain": None})
    for number in (1, 2):
        run.append_metrics({"round": number, "local": 0.6, "base": 0.5, "new": None, "hm": 0.55, "domain": None})
    assert run.plot().read_bytes()[:4] == b"\x89PNG"


def test_a_checkpoint_appears_whole_and_replaces_a_round_whole(tmp_path, monkeypatch):
    """Both files go into a hidden folder that is renamed: a failure leaves the old round (or none), never
    a round folder with half its files; ``replace=False`` (fedmvp ingest) never rewrites a round."""
    import pytest
    import torch

    from fedmvp import atomic
    from fedmvp.runs import RunError

    run = RunDir(tmp_path)
    run.save_checkpoint(1, {"w": torch.zeros(2)}, {"seed": 1})
    real = atomic.write_json

    def failing(path, obj):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic, "write_json", failing)
    for number in (1, 2):  # replacing round 1, writing round 2: both fail after the tensors were written
        with pytest.raises(OSError):
            run.save_checkpoint(number, {"w": torch.ones(2)}, {"seed": 2})
    monkeypatch.setattr(atomic, "write_json", real)
    assert run.rounds() == [1] and sorted(p.name for p in tmp_path.iterdir()) == ["round-0001"]
    assert run.load_checkpoint(1).state["seed"] == 1 and torch.equal(run.load_checkpoint(1).tensors["w"], torch.zeros(2))

    run.save_checkpoint(1, {"w": torch.ones(2)}, {"seed": 2})  # training's resume rewrites a round
    assert run.load_checkpoint(1).state["seed"] == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["round-0001"]
    with pytest.raises(RunError, match="round 1 already exists"):
        run.save_checkpoint(1, {"w": torch.zeros(2)}, {"seed": 3}, replace=False)
    assert run.load_checkpoint(1).state["seed"] == 2
