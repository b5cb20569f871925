"""A hostile site folder at every command that reads one: `fedmvp join --data`, `fedmvp evaluate --data`,
`fedmvp train` on a preset naming it. One row each: the folder's defect, the command, the fragment of the
one error line; every row must end with exit 2 within its timeout, so a hang fails the row instead of the
suite (a FIFO and two loop links used to hang the check forever). Rows run the command's click entry in
this process (a fresh interpreter costs 6-20 s of imports) under a timeout, the SuperNode a join would
become replaced by an exit 0; the ``REAL`` rows run the real script in its own process.

The rule is ``fedmvp_formats.folder_walk`` (docs/howto/datasets.md "Links in a data folder"); its unit
table is tests/test_folder_walk.py, the device's rows are in test_edge_client.py.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.data_trees import truncated_jpeg  # noqa: E402
from tests.hostile.disk import run, tree_digest  # noqa: E402
from tests.site_trees import site_preset, world_classes  # noqa: E402

TIMEOUT = 60  # a fresh interpreter imports torch and Flower (seconds under load); the check itself is instant
REAL = {"join-fifo", "join-two-loop-links"}  # as a user runs them: the console script in its own process


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A [federation] preset of two sites (clinics.toml, sites/a and sites/b), and a prepared run of it
    whose round 1 is written directly (evaluate --data refuses the folder before any model runs)."""
    import torch

    from fedmvp.federated.prepare import prepare_run
    from fedmvp.runs import RunDir
    from fedmvp.synthetic.writer import write_world

    base = tmp_path_factory.mktemp("folders")
    world = write_world(base / "world", counts={"train": 3, "test": 2}, domains=["photo"])
    seen, held = world_classes(world)
    site_preset(base, world, {"a": seen[:2] + held[:1], "b": seen[2:4]}, held[:1], rounds=1)
    run_dir = RunDir(prepare_run(str(base / "clinics.toml"), str(base / "run"), None, False, "cpu").path)
    run_dir.save_checkpoint(1, {"promptformer.w": torch.zeros(2)}, {"method": run_dir.read_config()["method"]})
    return base


# ---- defects: each makes a copy of site a's folder bad in one way -------------------------------------------
def _classes(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir())


def _link_up(folder: Path) -> None:
    (_classes(folder)[0] / "up").symlink_to("..")


def _two_loops(folder: Path) -> None:
    (_classes(folder)[0] / "a").symlink_to("..")
    (_classes(folder)[0] / "b").symlink_to("../..")


def _sibling(folder: Path) -> None:
    first, second = _classes(folder)[:2]
    (first / "more").symlink_to(os.path.relpath(second, first))


def _hard_link(folder: Path) -> None:
    first, second = _classes(folder)[:2]
    os.link(next(first.iterdir()), second / "same.png")


def _fifo(folder: Path) -> None:
    os.mkfifo(_classes(folder)[0] / "x.jpg")


def _truncated(folder: Path) -> None:
    truncated_jpeg(_classes(folder)[0] / "cut.jpg")


def _escape_name(folder: Path) -> None:
    truncated_jpeg(_classes(folder)[0] / "evil\n\x1b[2Jname.jpg")


DEFECTS: dict[str, Callable[[Path], None]] = {
    "link-up": _link_up, "two-loop-links": _two_loops, "sibling-class-link": _sibling, "hard-link": _hard_link,
    "fifo": _fifo, "truncated-jpeg": _truncated, "escape-in-name": _escape_name,
}
FRAGMENTS = {"link-up": "leads back into", "two-loop-links": "leads back into",
             "sibling-class-link": "leads back into", "hard-link": "the same file as",
             "fifo": "a FIFO (named pipe), not an image file", "truncated-jpeg": "cut.jpg: unreadable image",
             "escape-in-name": "evil\\n\\x1b[2Jname.jpg: unreadable image"}


@dataclass(frozen=True)
class Row:
    command: str  # join | evaluate | train
    defect: str

    @property
    def id(self) -> str:
        return f"{self.command}-{self.defect}"


ROWS = [Row("join", d) for d in DEFECTS] + [Row("evaluate", d) for d in ("link-up", "fifo", "truncated-jpeg")] \
    + [Row("train", d) for d in ("two-loop-links", "fifo")]


def _args(row: Row, root: Path, folder: Path) -> list[str]:
    if row.command == "join":  # the check runs before anything connects: nothing listens on port 9
        return ["join", "--superlink", "127.0.0.1:9", "--insecure", "--config", str(root / "clinics.toml"),
                "--data", str(folder), "--name", "a"]
    if row.command == "evaluate":
        return ["evaluate", "--run", str(root / "run"), "--data", str(folder), "--name", "a"]
    preset = folder.parent / "preset.toml"
    preset.write_text((root / "clinics.toml").read_text().replace('data = "sites/a"', f'data = "{folder}"'))
    (folder.parent / "attributes.json").write_text((root / "attributes.json").read_text())
    (folder.parent / "sites").symlink_to(root / "sites")  # site b, as the preset names it
    return ["train", "--config", str(preset), "--run-dir", str(folder.parent / "r")]


def assert_refused(done, fragment: str, took: float, lines: int = 1) -> None:
    """Exit 2, one error line per problem (``lines``), each holding ``fragment``, no traceback, no raw
    control character, in seconds."""
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-3000:]
    assert "Traceback" not in output and "\x1b" not in output, output[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == lines and all(fragment in line for line in errors), output[-3000:]
    assert took < TIMEOUT


def _no_supernode(args, **_) -> None:
    raise SystemExit(0)  # the folder passed the check: a join would now become a SuperNode


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("row", [pytest.param(r, id=r.id, marks=[pytest.mark.processes] if r.id in REAL else []) for r in ROWS])
def test_a_bad_site_folder_is_one_line_and_exit_2(root, tmp_path, row, monkeypatch):
    monkeypatch.setattr("fedmvp_apps.deploy.supernode.become_supernode", _no_supernode)
    folder = tmp_path / "site"
    shutil.copytree(root / "sites" / "a", folder)
    DEFECTS[row.defect](folder)
    before = tree_digest(root / "run")
    began = time.monotonic()
    done = run("fedmvp", _args(row, root, folder), cwd=tmp_path, timeout=TIMEOUT - 5, in_process=row.id not in REAL)
    assert_refused(done, FRAGMENTS[row.defect], time.monotonic() - began, 2 if row.id == "join-two-loop-links" else 1)
    assert tree_digest(root / "run") == before and not (tmp_path / "r").exists()


# ---- the preset's own mistakes: refused before anything is read ----------------------------------------------
@pytest.mark.parametrize("change, fragment", [
    (lambda text: text.replace('data = "sites/b"', 'data = "sites/a"'), "read the same images"),
    (lambda text: text.replace('data = "sites/b"', 'data = "sites/a/../a"'), "read the same images"),
    (lambda text: text.replace("new_classes", "eval_fraction = 0\nnew_classes"), "eval_fraction must be in (0, 1)"),
], ids=["same-folder-twice", "same-folder-by-another-path", "eval-fraction-0"])
def test_a_preset_that_would_count_a_folder_twice_or_measure_no_base_is_refused(root, tmp_path, change, fragment):
    preset = root / f"p-{tmp_path.name}.toml"
    preset.write_text(change((root / "clinics.toml").read_text()))
    done = run("fedmvp", ["train", "--config", str(preset), "--run-dir", str(tmp_path / "r")], cwd=root)
    assert_refused(done, fragment, 0.0)
    assert not (tmp_path / "r").exists()
