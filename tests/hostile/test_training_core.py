"""Hostile input to the training core (`fedmvp train`, `evaluate`, `world`, `ingest`): one line, a
meaningful exit code, nothing changed. Rows that would need training fail before it starts."""

from __future__ import annotations

import click
import pytest

from fedmvp_apps.cli import SUBCOMMANDS, main


def _float_flags() -> list[tuple[str, str]]:
    """(subcommand, --flag) of every float option of the `fedmvp` command line."""
    ctx = click.Context(main)
    out = []
    for name in SUBCOMMANDS:
        command = main.get_command(ctx, name)
        for param in command.params:
            if isinstance(param, click.Option) and isinstance(param.type, click.types.FloatParamType):
                out.append((name, param.opts[0]))
    return out


@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("command,flag", _float_flags())
def test_every_float_flag_refuses_non_finite_values(command, flag, value):
    """No range check catches NaN (`x < 0` is false), so each float flag checks finiteness itself."""
    from fedmvp_apps.cli.common import FiniteFloat

    param = next(p for p in main.get_command(click.Context(main), command).params if flag in p.opts)
    assert isinstance(param.type, FiniteFloat), f"fedmvp {command} {flag} is a plain float"
    with pytest.raises(click.BadParameter, match="not a finite number|not in the range"):
        param.type.convert(value, param, None)


def test_the_float_flags_are_found():
    assert {("serve", "--fraction"), ("serve", "--round-timeout"), ("pretrain-tiny", "--lr")} <= set(_float_flags())


# ---- the table: `fedmvp train`, `evaluate`, `world`, `ingest` as a user runs them -------------------------
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from tests.deadlines import scaled
from tests.federated.conftest import PRESET  # noqa: E402
from tests.hostile.disk import Hostile, assert_one_line_error, run, tree_digest  # noqa: E402



@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A world, a good preset, bad presets, and prepared runs (never trained: a round is written directly)."""
    import torch

    from fedmvp.federated.prepare import prepare_run
    from fedmvp.runs import RunDir
    from fedmvp.synthetic.writer import write_world

    base = tmp_path_factory.mktemp("hostile")
    world = write_world(base / "world", counts={"train": 2, "test": 2}, domains=["photo", "painting"])
    good = PRESET.format(root=world, sigma=1000.0)
    presets = {"good": good, "rounds0": good.replace("rounds = 3", "rounds = 0"),
               "rounds-1": good.replace("rounds = 3", "rounds = -1"),
               "rounds1e9": good.replace("rounds = 3", "rounds = 1e9"),
               "lrnan": good.replace("shots = 2", "shots = 2\nlr = nan"),
               "alphainf": good.replace("alpha = 5.0", "alpha = inf"),
               "duplicate": good.replace("shots = 2", "shots = 2\nshots = 3"),
               "table": good + "\n[optimizer]\nname = 'adam'\n",
               "rootfile": good.replace(f'root = "{world}"', f'root = "{world / "world.json"}"'),
               # values found only once the run started (exit 1, a run directory left behind)
               "buffered": good + "\n[server]\nmode = 'buffered'\n",
               "clip": good.replace('clip = "fedmvp-tiny"', 'clip = "no-such-clip"'),
               "weights": good.replace('pretrained = ""', 'pretrained = "/nonexistent/clip.safetensors"'),
               "tag": good.replace('pretrained = ""', 'pretrained = "no-such-tag"'),
               "hub": good.replace('clip = "fedmvp-tiny"', 'clip = "hf-hub:nobody/no-such-clip"'),
               "seed2e19": good.replace("seed = 3", "seed = 20000000000000000000"),
               "seed-1": good.replace("seed = 3", "seed = -1"),
               "worldseed-1": good.replace('layout = "synthetic"', 'layout = "synthetic"\nworld_seed = -1')}
    for name, text in presets.items():
        (base / f"{name}.toml").write_text(text)
    (base / "dir.toml").mkdir()
    (base / "a-file").write_text("not a folder\n")
    (base / "empty").mkdir()
    for name in ("run", "listconfig", "liststate", "nanround", "corrupt", "other"):
        path = base / name
        prepare_run(str(base / "good.toml"), str(path), None, False, "cpu")
        for number in (1, 2):  # every row fails before training starts
            RunDir(path).save_checkpoint(number, {"promptformer.w": torch.zeros(2)},
                                         {"method": RunDir(path).read_config()["method"]})
    (base / "listconfig" / "config.json").write_text("[1, 2]")
    (base / "liststate" / "round-0001" / "state.json").write_text('["complete"]')
    from safetensors.torch import save_file

    save_file({"promptformer.w": torch.tensor([float("nan"), 0.0])}, str(base / "nanround" / "round-0002" /
                                                                         "global.safetensors"))
    (base / "corrupt" / "round-0002" / "global.safetensors").write_bytes(b"\x00" * 20)
    (base / "other.toml").write_text(good.replace("shots = 2", "shots = 1"))
    return base


def _train(preset: str, run_dir: str, *extra: str) -> list[str]:
    return ["train", "--config", preset, "--run-dir", run_dir, *extra]


ROWS = [
    Hostile("rounds-0", _train("rounds0.toml", "r"), 2, "rounds must be at least 1", ["rounds0.toml"]),
    Hostile("rounds-negative", _train("rounds-1.toml", "r"), 2, "rounds must be at least 1"),
    Hostile("rounds-1e9", _train("rounds1e9.toml", "r"), 2, "rounds must be an integer, got 1000000000.0"),
    Hostile("lr-nan", _train("lrnan.toml", "r"), 2, "lr must be a finite number, got nan"),
    Hostile("alpha-inf", _train("alphainf.toml", "r"), 2, "alpha must be a finite number, got inf"),
    Hostile("duplicate-key", _train("duplicate.toml", "r"), 2, "invalid TOML"),
    Hostile("mode-buffered-in-a-simulation", _train("buffered.toml", "r"), 2,
            "mode = 'buffered' trains on edge devices"),
    Hostile("clip-unknown", _train("clip.toml", "r"), 2, "[model]: unknown CLIP model 'no-such-clip'"),
    Hostile("clip-weights-missing", _train("weights.toml", "r"), 2,
            "[model]: /nonexistent/clip.safetensors: weights file not found"),
    Hostile("clip-tag-unknown", _train("tag.toml", "r"), 2, "'no-such-tag' is neither a pretrained tag"),
    Hostile("clip-hub-not-cached", _train("hub.toml", "r"), 2, "is not in the local cache and downloads are off"),
    Hostile("seed-past-64-bits", _train("seed2e19.toml", "r"), 2, "seed must be an integer from 0 to 2**63 - 1"),
    Hostile("seed-negative", _train("seed-1.toml", "r"), 2, "seed must be an integer from 0 to 2**63 - 1, got -1"),
    Hostile("world-seed-negative", _train("worldseed-1.toml", "r"), 2, "world_seed must be an integer from 0"),
    Hostile("serve-clip-unknown", ["serve", "--config", "clip.toml", "--run-dir", "r", "--insecure", "--address",
                                   "127.0.0.1:1"], 2, "[model]: unknown CLIP model 'no-such-clip'"),
    Hostile("unknown-table", _train("table.toml", "r"), 2, "unknown key 'optimizer'"),
    Hostile("root-is-a-file", _train("rootfile.toml", "r"), 2, "world.json does not exist"),
    Hostile("preset-is-a-directory", _train("dir.toml", "r"), 2, "dir.toml: cannot read"),
    Hostile("run-dir-is-a-file", _train("good.toml", "a-file"), 2, "is a file", ["a-file"]),
    Hostile("run-dir-not-writable", _train("good.toml", "a-file/run"), 2, "a-file: Not a directory",
            ["a-file"]),
    Hostile("resume-empty-dir", _train("good.toml", "empty", "--resume"), 2, "not a fedmvp run", ["empty"]),
    Hostile("resume-config-list", _train("good.toml", "listconfig", "--resume"), 2,
            "listconfig/config.json: not a JSON object", ["listconfig"]),
    Hostile("resume-state-list", _train("good.toml", "liststate", "--resume"), 2,
            "liststate/round-0001/state.json: not a JSON object", ["liststate"]),
    Hostile("resume-nan-checkpoint", _train("good.toml", "nanround", "--resume"), 2,
            "round-0002/global.safetensors: tensor promptformer.w holds NaN", ["nanround"]),
    Hostile("resume-corrupt-last-round", _train("good.toml", "corrupt", "--resume"), 2,
            "to resume from round 1", ["corrupt"]),
    Hostile("resume-another-preset", _train("other.toml", "other", "--resume"), 2, "not the preset",
            ["other"]),
    Hostile("resume-other-rounds", _train("good.toml", "run", "--resume", "--rounds", "5"), 2,
            "was started with 3 rounds", ["run"]),
    Hostile("evaluate-round-999", ["evaluate", "--run", "run", "--round", "999"], 2,
            "round 999 not found (complete rounds: 1, 2)", ["run"]),
    Hostile("evaluate-config-list", ["evaluate", "--run", "listconfig"], 2, "not a JSON object", ["listconfig"]),
    Hostile("evaluate-state-list", ["evaluate", "--run", "liststate", "--round", "2"], 2,
            "round-0001/state.json: not a JSON object", ["liststate"]),
    Hostile("evaluate-nan-checkpoint", ["evaluate", "--run", "nanround"], 2, "holds NaN or infinite values",
            ["nanround"]),
    Hostile("evaluate-a-file", ["evaluate", "--run", "a-file"], 2, "is a file", ["a-file"]),
    Hostile("world-out-is-a-file", ["world", "--out", "a-file", "--train", "1", "--val", "0", "--test", "0"], 2,
            "is a file", ["a-file"]),
    Hostile("world-out-not-writable", ["world", "--out", "a-file/w", "--train", "1", "--val", "0", "--test", "0"],
            2, "a-file: Not a directory", ["a-file"]),
    Hostile("ingest-a-directory", ["ingest", "--run", "run", "empty"], 2, "is a directory", ["run"]),
    Hostile("ingest-state-list", ["ingest", "--run", "liststate", "good.toml"], 2,
            "round-0001/state.json: not a JSON object", ["liststate"]),
    Hostile("ingest-run-config-list", ["ingest", "--run", "listconfig", "good.toml"], 2, "not a JSON object",
            ["listconfig"]),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_hostile_input_is_one_line_and_changes_nothing(root, row):
    before = {path: tree_digest(root / path) for path in row.unchanged}
    done = run("fedmvp", row.args, cwd=root, timeout=120)
    assert_one_line_error(done, row.exit_code, row.fragment)
    assert {path: tree_digest(root / path) for path in row.unchanged} == before
    assert not (root / "r").exists()  # a refused run leaves no run directory behind


@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
def test_kill_9_of_fedmvp_train_leaves_no_ray_helpers(root):
    """kill -9 of `fedmvp train` (the process, not its group) used to leave ray::DashboardAgent and
    ray::RuntimeEnvAgent running (~90 MB each): the watchdog (fedmvp_apps/watchdog.py) ends them."""
    import signal
    import subprocess
    import time

    from fedmvp_apps.watchdog import descendants

    if not Path("/proc/self/stat").exists():
        pytest.skip("the watchdog reads /proc (Linux)")
    # 500 rounds: still training when Ray's agents are up, however slowly a loaded machine starts them (at 50,
    # a loaded CI machine finished the run first)
    (root / "long.toml").write_text((root / "good.toml").read_text().replace("rounds = 3", "rounds = 500"))
    proc = subprocess.Popen([str(Path(sys.executable).parent / "fedmvp"), *_train("long.toml", "killed")],
                            cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + scaled(90)
        while True:
            agents = {pid: start for pid, start in descendants(proc.pid).items()
                      if b"Agent" in _cmdline(pid)} if proc.poll() is None else {}
            if len(agents) >= 2:
                break
            assert proc.poll() is None and time.time() < deadline, "Ray's agents never started"
            time.sleep(0.5)
        started = descendants(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.time() + scaled(20)
        while True:
            alive = [pid for pid, start in started.items() if _alive(pid, start)]
            if not alive or time.time() > deadline:
                break
            time.sleep(0.5)
        assert not alive, [_cmdline(pid)[:60] for pid in alive]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group, if the test failed
        except OSError:
            pass


def _cmdline(pid: int) -> bytes:
    """A process's command line; empty once it is gone (it may exit between listing and reading)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int, start: int) -> bool:
    from fedmvp_apps.watchdog import _stat

    stat = _stat(pid)
    return stat is not None and stat[1] == start


def test_the_exporter_names_a_state_json_that_is_not_an_object(root):
    """Even a round not in use: the run reader sees every round's state.json."""
    before = tree_digest(root / "liststate")
    done = run("fedmvp-export", ["--run", "liststate", "--round", "2", "--out", "bundle"], cwd=root, timeout=120)
    assert_one_line_error(done, 2, "liststate/round-0001/state.json: not a JSON object")
    assert tree_digest(root / "liststate") == before and not (root / "bundle").exists()


def test_world_names_the_path_when_the_disk_fills_while_writing(tmp_path, monkeypatch):
    from click.testing import CliRunner

    import fedmvp.synthetic.writer as writer

    def full(out, *args, **kwargs):
        raise OSError(28, "No space left on device", str(out / "photo" / "train"))

    monkeypatch.setattr(writer, "write_world", full)
    result = CliRunner().invoke(main, ["world", "--out", str(tmp_path / "w"), "--train", "1", "--val", "0",
                                       "--test", "0"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"{tmp_path / 'w' / 'photo' / 'train'}: No space left on device" in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders (the a-file rows cover this)")
def test_a_read_only_run_folder_stops_train_before_it_starts(root, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        done = run("fedmvp", _train(str(root / "good.toml"), str(locked / "run")), cwd=root, timeout=120)
        assert_one_line_error(done, 2, "Permission denied")
    finally:
        locked.chmod(0o755)
