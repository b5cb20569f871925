"""Where edge-client may write: a run directory is recognised by its marker (config.json ``format``), or, for a
run made before the marker, by the files every run wrote beside its config.json; never by keys a config.json
happens to hold (any tool writes a config.json)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from edge_client.write_guard import WriteTargetError, check_output_file, is_run_dir


def _config(folder: Path, record: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(record))


def _written_by_fedmvp(folder: Path) -> None:
    from fedmvp.runs import RunDir  # the one writer of a run's config.json

    RunDir(folder).write_config({"preset": "x", "seed": 0})


def _marked(marker: str) -> Callable[[Path], None]:
    return lambda folder: _config(folder, {"format": marker})


def _before_the_marker(companion: str) -> Callable[[Path], None]:
    def make(folder: Path) -> None:
        _config(folder, {"preset": "x", "model": {"clip": "fedmvp-tiny"}})
        (folder / companion).parent.mkdir(parents=True, exist_ok=True)
        (folder / companion).write_text("{}")
    return make


FOLDERS = [  # (how the folder is made, whether it is a run)
    ("written-by-RunDir", _written_by_fedmvp, True),
    ("marked", _marked("fedmvp-run/1"), True),
    ("marked-by-a-newer-fedmvp", _marked("fedmvp-run/7"), True),
    ("old-run-with-a-round", _before_the_marker("round-0001/state.json"), True),
    ("old-run-with-its-preset-copy", _before_the_marker("preset.toml"), True),
    ("old-run-with-classes", _before_the_marker("classes.json"), True),
    ("old-run-with-metrics", _before_the_marker("metrics.jsonl"), True),
    ("similar-keys-only", lambda f: _config(f, {"preset": "x", "model": {"clip": "fedmvp-tiny"}}), False),
    ("similar-keys-and-a-rounds-folder", _before_the_marker("rounds/state.json"), False),
    ("another-tool's-format", lambda f: _config(f, {"format": "webpack/5", "preset": "x"}), False),
    ("config-not-json", lambda f: (f.mkdir(), (f / "config.json").write_text("preset = 1")), False),
    ("no-config", lambda f: (f.mkdir(), (f / "preset.toml").write_text("")), False),
]


@pytest.mark.parametrize("make,is_run", [(m, r) for _, m, r in FOLDERS], ids=[n for n, _, _ in FOLDERS])
def test_a_run_is_known_by_its_marker_not_by_similar_keys(tmp_path, make, is_run):
    folder = tmp_path / "folder"
    make(folder)
    assert is_run_dir(folder) is is_run
    target = folder / "updates" / "u.safetensors"
    if is_run:
        with pytest.raises(WriteTargetError, match=f"inside a fedmvp run directory \\({folder}\\)"):
            check_output_file(target)
        check_output_file(target, allow_run_dir=True)  # `fedmvp demo` writes into the run it owns
    else:
        check_output_file(target)  # nothing to protect: the update may go there
