"""Run directories: the plot, checkpoints, the one reader of a round's state.json and its rule, the run marker."""

from __future__ import annotations

import pytest

from fedmvp.run_metrics import append_metrics, metrics_path, plot, read_metrics, truncate_metrics_after
from fedmvp.runs import RunDir


def test_plot_leaves_out_metrics_a_protocol_does_not_have(tmp_path):
    run = RunDir(tmp_path)
    run.write_zero_shot({"local": 0.5, "base": 0.4, "new": None, "hm": 0.45, "domain": None})
    for number in (1, 2):
        append_metrics(run, {"round": number, "local": 0.6, "base": 0.5, "new": None, "hm": 0.55, "domain": None})
    assert plot(run).read_bytes()[:4] == b"\x89PNG"


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


def test_non_finite_checkpoints_are_neither_written_nor_read(tmp_path):
    """A NaN checkpoint resumes and trains to NaN, then evaluates at chance with no warning."""
    import pytest
    import torch
    from safetensors.torch import save_file

    from fedmvp.runs import RunError

    run = RunDir(tmp_path)
    with pytest.raises(RunError, match=r"round-0001/global.safetensors: tensor lora.b holds NaN"):
        run.save_checkpoint(1, {"lora.a": torch.zeros(2), "lora.b": torch.tensor([1.0, float("nan")])}, {})
    assert run.rounds() == []
    run.save_checkpoint(1, {"lora.a": torch.zeros(2)}, {})
    save_file({"lora.a": torch.tensor([float("inf"), 0.0])}, str(run.round_path(1) / "global.safetensors"))
    with pytest.raises(RunError, match=r"round-0001/global.safetensors: tensor lora.a holds NaN or infinite"):
        run.load_checkpoint(1)


def test_a_state_json_that_is_not_an_object_is_named(tmp_path):
    import pytest
    import torch

    from fedmvp.runs import RunError

    run = RunDir(tmp_path)
    run.save_checkpoint(1, {"w": torch.zeros(2)}, {})
    run.save_checkpoint(2, {"w": torch.zeros(2)}, {})
    (run.round_path(1) / "state.json").write_text("[1, 2]")
    with pytest.raises(RunError, match=r"round-0001/state.json: not a JSON object \(got list\)"):
        run.load_checkpoint(2)  # even a round not in use
    run.config_path.write_text("[]")
    with pytest.raises(RunError, match="config.json: not a JSON object"):
        run.read_config()


def test_metrics_cut_short_are_rebuilt_from_the_rounds(tmp_path, capsys):
    import torch

    run = RunDir(tmp_path)
    for number in (1, 2):
        run.save_checkpoint(number, {"w": torch.zeros(2)}, {"metrics": {"round": number, "train_loss": 0.5}})
        append_metrics(run, {"round": number, "train_loss": 0.5})
    text = metrics_path(run).read_text()
    metrics_path(run).write_text(text[:-7])  # the last line cut by a full disk
    assert [r["round"] for r in read_metrics(run)] == [1]
    assert "metrics.jsonl: line 2 is not a JSON object" in capsys.readouterr().err
    truncate_metrics_after(run, 2)
    assert [r["round"] for r in read_metrics(run)] == [1, 2]


def test_from_run_is_the_one_rebuild_seed_clip_method_and_weights(tmp_path):
    """FedMVP.from_run (docs/architecture.md): the round's weights on the model its method record
    describes (the round's own record before config.json's); round 0 is the seed's initial model."""
    import pytest
    import torch

    from fedmvp.model import FedMVP
    from fedmvp.runs import RunError
    from tests.run_fixtures import write_run

    write_run(tmp_path / "run", tmp_path / "preset.toml", "", "t", seed=3)
    run = RunDir(tmp_path / "run")
    checkpoint = run.load_checkpoint(2)
    model = FedMVP.from_run(run, 2)
    assert not model.training and model.config.lora_rank == 4 and model.clip_info.name == "fedmvp-tiny"
    assert all(torch.equal(v, checkpoint.tensors[k]) for k, v in model.state("all").items())
    initial, built = FedMVP.from_run(run, 0), FedMVP.build("fedmvp-tiny", None, run.method(), 3)
    assert all(torch.equal(v, built.state_dict()[k]) for k, v in initial.state_dict().items())
    config = run.read_config()
    config["method"] = {**config["method"], "lora_rank": 2}
    run.write_config(config)
    assert FedMVP.from_run(run, 2).config.lora_rank == 4  # round 2's state.json record, not config.json's
    assert FedMVP.from_run(run, 0).config.lora_rank == 2
    del config["method"]
    run.write_config(config)
    with pytest.raises(RunError, match="config.json: no method record"):
        FedMVP.from_run(run, 0)
    del config["seed"]
    run.write_config(config)
    with pytest.raises(RunError, match="config.json: no seed record"):
        FedMVP.from_run(run, 2)


# ---- the one reader of a round's record (RunDir.round_state) and its one error rule ----------------------
def _missing(path):
    path.unlink()


def _cut_short(path):
    path.write_text(path.read_text()[:7])


def _a_list(path):
    path.write_text("[1, 2]")


def _a_link(path):
    other = path.parent.parent / "elsewhere.json"
    other.write_text('{"complete": true, "round": 1}')
    path.unlink()
    path.symlink_to(other)


def _a_directory(path):
    path.unlink()
    path.mkdir()


def _not_utf8(path):
    path.write_bytes(b'{"round": "\xff"}')


STATE_PROBLEMS = [  # (how state.json is spoiled, what the line says, whether rounds() still lists others)
    (_missing, "round-0001/state.json: missing", "skipped"),
    (_cut_short, r"round-0001/state.json: cut short or not JSON \(", "skipped"),
    (_not_utf8, r"round-0001/state.json: cut short or not JSON \(", "skipped"),
    (_a_directory, "round-0001/state.json: not a regular file", "skipped"),
    (_a_list, r"round-0001/state.json: not a JSON object \(got list\)", "refused"),
    (_a_link, "round-0001/state.json: a symbolic link", "refused"),
]


@pytest.mark.parametrize("spoil,line,in_rounds", STATE_PROBLEMS, ids=[s[0].__name__ for s in STATE_PROBLEMS])
def test_a_round_state_is_read_by_one_rule(tmp_path, spoil, line, in_rounds):
    """Every reader of a round's state.json (ingest, the privacy budget, the metrics, the benchmarks) asks
    RunDir.round_state: one RunError naming the file and the problem. rounds() takes a state.json missing,
    unreadable or cut short for an unfinished round, and stops at corruption (a list, a link)."""
    import torch

    from fedmvp.runs import RecordError, RunError

    run = RunDir(tmp_path / "run")
    for number in (1, 2):
        run.save_checkpoint(number, {"w": torch.zeros(2)}, {"metrics": {"round": number}})
    assert run.round_state(1)["complete"] is True and run.round_state(2)["metrics"] == {"round": 2}
    spoil(run.round_state_path(1))
    with pytest.raises(RecordError, match=line) as caught:
        run.round_state(1)
    assert isinstance(caught.value, RunError) and len(str(caught.value).splitlines()) == 1
    if in_rounds == "skipped":
        assert run.rounds() == [2]
    else:
        with pytest.raises(RunError, match=line):
            run.rounds()


@pytest.mark.parametrize("spoil,line,_", STATE_PROBLEMS, ids=[s[0].__name__ for s in STATE_PROBLEMS])
def test_readers_of_earlier_rounds_use_the_one_rule(tmp_path, monkeypatch, spoil, line, _):
    """ingest's earlier acceptances, the privacy budget's events, the metrics rebuilt from the rounds and
    the benchmarks' trained round all read a state.json through RunDir.round_state: the same line each
    (rounds() is held to list the spoiled round, as if it was spoiled after it was listed)."""
    import torch

    from benchmarks.privacy import trained_round
    from fedmvp.federated.ingest import accepted_before
    from fedmvp.federated.privacy_budget import run_events
    from fedmvp.run_metrics import truncate_metrics_after
    from fedmvp.runs import RunError

    run = RunDir(tmp_path / "run")
    for number in (1, 2):
        run.save_checkpoint(number, {"w": torch.zeros(2)}, {"source": "ingest"})
    spoil(run.round_state_path(1))
    monkeypatch.setattr(RunDir, "rounds", lambda self: [1, 2])
    for reader in (accepted_before, run_events, lambda r: truncate_metrics_after(r, 2), trained_round):
        with pytest.raises(RunError, match=line):
            reader(run)


def test_zero_shot_is_read_and_written_by_the_run(tmp_path):
    from fedmvp.runs import RunError

    run = RunDir(tmp_path)
    assert run.read_zero_shot() is None
    run.write_zero_shot({"hm": 0.5})
    assert run.read_zero_shot() == {"hm": 0.5} and (tmp_path / RunDir.ZERO_SHOT).is_file()
    (tmp_path / RunDir.ZERO_SHOT).write_text('{"hm": 0.')
    with pytest.raises(RunError, match="zero_shot.json: cut short or not JSON"):
        run.read_zero_shot()


# ---- the run marker (config.json "format") -------------------------------------------------------------
def test_a_new_run_is_marked_and_a_run_before_the_marker_still_opens(tmp_path):
    import json

    from fedmvp.runs import RunError
    from fedmvp_formats.files import RUN_FORMAT

    run = RunDir(tmp_path)
    run.write_config({"seed": 1, "format": "stale"})
    on_disk = json.loads(run.config_path.read_text())
    assert list(on_disk) == ["format", "seed"] and on_disk["format"] == RUN_FORMAT == "fedmvp-run/1"
    run.config_path.write_text(json.dumps({"seed": 1}))  # written by a fedmvp before the marker
    assert run.read_config() == {"seed": 1} and run.seed == 1
    assert json.loads(run.config_path.read_text()) == {"seed": 1}  # nothing written back
    for marker, why in (("fedmvp-run/2", "made by a newer fedmvp"), ("something-else/1", "not a fedmvp run's")):
        run.config_path.write_text(json.dumps({"format": marker, "seed": 1}))
        with pytest.raises(RunError, match=f"config.json: format '{marker}' \\({why}.*reads fedmvp-run/1\\)"):
            run.read_config()


def test_config_json_keeps_its_lines(tmp_path):
    from fedmvp.runs import RunError

    with pytest.raises(RunError, match="not a fedmvp run \\(no config.json\\)"):
        RunDir(tmp_path / "nowhere").read_config()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(RunError, match="afile: not a directory"):
        RunDir(tmp_path / "afile").read_config()
    (tmp_path / "dir" / "config.json").mkdir(parents=True)
    with pytest.raises(RunError, match="config.json: not a regular file"):
        RunDir(tmp_path / "dir").read_config()
