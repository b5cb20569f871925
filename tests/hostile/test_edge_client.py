"""Hostile inputs to `edge-client`, one table row each: what is typed, the exit code, a fragment of the
one line the user reads, and the paths that must be byte-identical afterwards.

Each row runs the console script in a fresh directory holding ``bundle/`` (a private copy of one
exported bundle, so ./bundle is the default), ``img.jpg``, ``local/`` (labelled images) and
whatever the row's setup adds. Rows cover the hostile-input review of edge-client (items 1-8 of
its brief) and cases of our own.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fedmvp_formats.bundle_manifest import DEVICE_ID_FILE
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "edge_client"))
from disk import Hostile, assert_one_line_error, run, tree_digest  # noqa: E402
from edge_helpers import class_image, write_local_data  # noqa: E402
from fedmvp_formats.files import RUN_FORMAT  # noqa: E402

ROOT_IGNORES_PERMISSIONS = hasattr(os, "geteuid") and os.geteuid() == 0


# ---- setups: what a row adds to its directory before the command runs ----------------------------------
def _manifest(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        path = root / "bundle" / "manifest.json"
        manifest = json.loads(path.read_text())
        change(manifest)
        path.write_text(json.dumps(manifest))
    return setup


def _swap_names(m: dict) -> None:
    names = m["classes"]["names"]
    names[0], names[1] = names[1], names[0]


def _personalise(root: Path, count: int = 2) -> list[Path]:
    """Apply ``count`` updates (in process, no training): personalised/ with history."""
    from edge_client.bundle import read_bundle
    from edge_client.lora_store import apply_update
    from edge_client.update import write_update

    bundle = read_bundle(root / "bundle")
    paths = []
    for i in range(count):
        tensors = {k: v + np.float32(0.01 * (i + 1)) for k, v in bundle.lora().items()}
        paths.append(write_update(root / f"u{i}.safetensors", tensors, bundle=bundle, num_examples=2, mean_loss=1.0))
        apply_update(bundle, paths[-1])
    return paths


def _active_update(metadata: dict[str, str] | None = None, other_bundle: bool = False) -> Callable[[Path], None]:
    """personalised/ whose active entry (sha256 right) is an update with ``metadata`` changed, or one
    trained on another bundle."""
    def setup(root: Path) -> None:
        from safetensors.numpy import load_file, save_file

        from edge_client.bundle import read_bundle, sha256_file
        from fedmvp_formats.update import raw_metadata as _read_metadata

        _personalise(root, 1)
        state_path = root / "bundle" / "personalised" / "state.json"
        state = json.loads(state_path.read_text())
        lora = root / "bundle" / "personalised" / state["active"]["file"]
        meta = {**_read_metadata(lora.read_bytes()), **(metadata or {})}
        if other_bundle:
            meta["bundle_id"] = "0" * 64
        save_file(load_file(str(lora)), str(lora), metadata=meta)
        state["active"].update(sha256=sha256_file(lora), bytes=lora.stat().st_size)
        state_path.write_text(json.dumps(state))
        assert read_bundle(root / "bundle")  # the bundle itself still verifies
    return setup


def _malformed_history(root: Path) -> None:
    _personalise(root, 2)
    state_path = root / "bundle" / "personalised" / "state.json"
    state = json.loads(state_path.read_text())
    state["history"] = [["lora-0001.safetensors"]]
    state_path.write_text(json.dumps(state))


def _foreign_temp(root: Path) -> None:
    """A live process's (the one that started pytest) half-written file in personalised/: rollback must leave it."""
    _personalise(root, 2)
    (root / "bundle" / "personalised" / f".lora-0009.safetensors.{os.getppid()}.abcd.tmp").write_bytes(b"mine")


def _existing(root: Path) -> None:
    (root / "mine.safetensors").write_bytes(b"precious")


def _run_dir(root: Path) -> None:
    (root / "myrun").mkdir()
    (root / "myrun" / "config.json").write_text(json.dumps({"format": RUN_FORMAT, "preset": "x"}))  # a run's marker


def _lookalike_config(root: Path) -> None:
    """A folder whose config.json merely has a run's keys: not a run (no marker, none of a run's files)."""
    (root / "lookalike").mkdir()
    (root / "lookalike" / "config.json").write_text(json.dumps({"preset": "x", "model": {"clip": "fedmvp-tiny"}}))


def _link_into_bundle(root: Path) -> None:
    (root / "link").symlink_to(root / "bundle")


def _file_named(name: str) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        (root / name).write_text("not a directory\n")
    return setup


def _read_only_out(root: Path) -> None:
    (root / "ro").mkdir()
    (root / "ro").chmod(0o500)


def _empty_classes(root: Path) -> None:
    for name in ("red_circle", "blue_square"):
        (root / "empty" / name).mkdir(parents=True)


def _one_empty_class(root: Path) -> None:
    (root / "local" / "green_triangle").mkdir()


def _no_bundle(root: Path) -> None:
    shutil.rmtree(root / "bundle")


def _image_dir(root: Path) -> None:
    (root / "photo.jpg").mkdir()


def _non_utf8(root: Path) -> None:
    folder = os.path.join(os.fsencode(root), b"imgs")
    os.mkdir(folder)
    with open(os.path.join(folder, b"bad-\xfe.png"), "wb") as handle:
        handle.write(b"not an image")


def _unknown_class(root: Path) -> None:
    write_local_data(root / "other", ["red_circle"], per_class=1)
    (root / "other" / "zebra").mkdir()


def _class_link_up(root: Path) -> None:
    shutil.rmtree(root / "local" / "red_circle")
    (root / "local" / "red_circle").symlink_to("..")


def _hard_link_across_classes(root: Path) -> None:
    os.link(next((root / "local" / "red_circle").iterdir()), root / "local" / "blue_square" / "same.png")


def _file_link_to_another_class(root: Path) -> None:
    image = next((root / "local" / "red_circle").iterdir())
    (root / "local" / "blue_square" / "also.png").symlink_to(Path("..") / "red_circle" / image.name)


def _fifo_in_class(root: Path) -> None:
    os.mkfifo(root / "local" / "red_circle" / "x.jpg")


def _escape_in_name(root: Path) -> None:
    (root / "local" / "red_circle" / "evil\x1b[2J\nname.png").write_bytes(b"not an image")


SETUPS: dict[str, Callable[[Path], None]] = {
    "hard-link-across-classes": _hard_link_across_classes,
    "file-link-to-another-class": _file_link_to_another_class,
    "fifo-in-class-folder": _fifo_in_class,
    "escape-in-name-skipped": _escape_in_name,
    "class-folder-links-up": _class_link_up,
    "out-is-bundle-weights": lambda root: None,
    "out-symlink-into-bundle": _link_into_bundle,
    "out-exists": _existing,
    "out-inside-run": _run_dir,
    "out-beside-a-lookalike-config": _lookalike_config,
    "out-below-a-file": _file_named("afile"),
    "out-read-only": _read_only_out,
    "rollback-keeps-foreign-temp": _foreign_temp,
    "swapped-class-names-infer": _manifest(_swap_names),
    "swapped-class-names-info": _manifest(_swap_names),
    "fewer-names-than-outputs": _manifest(lambda m: m["classes"].update(
        names=m["classes"]["names"][:-1], count=m["classes"]["count"] - 1)),
    "count-disagrees": _manifest(lambda m: m["classes"].update(count=99)),
    "duplicate-class": _manifest(lambda m: m["classes"]["names"].__setitem__(1, m["classes"]["names"][0])),
    "preprocess-wrong-type": _manifest(lambda m: m.update(preprocess="bicubic")),
    "classes-wrong-type": _manifest(lambda m: m.update(classes=["a"])),
    "lora-tensors-not-mapping": _manifest(lambda m: m["lora"].update(tensors=[["x", [1]]])),
    "update-no-examples": _active_update({"num_examples": "0"}),
    "update-nan-loss": _active_update({"mean_loss": "nan"}),
    "update-of-another-bundle": _active_update(other_bundle=True),
    "all-class-folders-empty": _empty_classes,
    "one-empty-class-reported": _one_empty_class,
    "non-utf8-name-json": _non_utf8,
    "malformed-history-rollback": _malformed_history,
    "malformed-history-infer": _malformed_history,
    "no-bundle-anywhere": _no_bundle,
    "bundle-is-a-file": _file_named("afile"),
    "rollback-nothing": lambda root: None,
    "image-is-a-directory": _image_dir,
    "unknown-class": _unknown_class,
    "data-is-a-class-folder": lambda root: None,
}

_TRAIN = ["train", "--epochs", "1", "--batch-size", "4"]
ROWS = [
    # 1: outputs never land inside a bundle or run, never over a file
    Hostile("out-is-bundle-weights", [*_TRAIN, "--data", "local", "--out", "bundle/weights.safetensors"], 2,
            "inside a fedmvp bundle", ["bundle"]),
    Hostile("out-symlink-into-bundle", [*_TRAIN, "--data", "local", "--out", "link/u.safetensors"], 2,
            "inside a fedmvp bundle", ["bundle"]),
    Hostile("out-exists", [*_TRAIN, "--data", "local", "--out", "mine.safetensors"], 2, "already exists",
            ["mine.safetensors", "bundle"]),
    Hostile("out-inside-run", [*_TRAIN, "--data", "local", "--out", "myrun/updates"], 2,
            "inside a fedmvp run directory", ["myrun", "bundle"]),
    Hostile("out-beside-a-lookalike-config", [*_TRAIN, "--data", "local", "--no-apply", "--out", "lookalike/updates"],
            0, "lookalike/updates", ["bundle"]),
    # 7: unwritable targets, checked before training
    Hostile("out-below-a-file", [*_TRAIN, "--data", "local", "--out", "afile/updates"], 2, "not a directory",
            ["afile", "bundle"]),
    Hostile("out-read-only", [*_TRAIN, "--data", "local", "--out", "ro"], 2, "cannot write the update file",
            ["ro", "bundle"]),
    # 2: cleanup leaves another process's temp file alone
    Hostile("rollback-keeps-foreign-temp", ["rollback"], 0, "rolled back", [f"bundle/personalised/.lora-0009"
            f".safetensors.{os.getppid()}.abcd.tmp"]),
    # 3: manifest integrity
    Hostile("swapped-class-names-infer", ["infer", "img.jpg"], 2, "manifest.json: field classes.names", ["bundle"]),
    Hostile("swapped-class-names-info", ["info"], 2, "manifest.json: field classes.names", ["bundle"]),
    Hostile("fewer-names-than-outputs", ["infer", "img.jpg"], 2, "field onnx.num_classes", ["bundle"]),
    Hostile("count-disagrees", ["infer", "img.jpg"], 2, "field classes.count", ["bundle"]),
    Hostile("duplicate-class", ["infer", "img.jpg"], 2, "names a class twice", ["bundle"]),
    Hostile("preprocess-wrong-type", ["infer", "img.jpg"], 2, "manifest.json: field preprocess", ["bundle"]),
    Hostile("classes-wrong-type", ["train", "--data", "local"], 2, "manifest.json: field classes", ["bundle"]),
    Hostile("lora-tensors-not-mapping", ["rollback"], 2, "manifest.json: field lora.tensors", ["bundle"]),
    # 4: update weight and loss
    Hostile("update-no-examples", ["infer", "img.jpg"], 2, "num_examples '0'", ["bundle"]),
    Hostile("update-nan-loss", ["infer", "img.jpg"], 2, "mean_loss 'nan'", ["bundle"]),
    Hostile("update-of-another-bundle", ["infer", "img.jpg"], 2, "trained on bundle 000000000000", ["bundle"]),
    # 5: empty class folders
    Hostile("all-class-folders-empty", ["train", "--data", "empty"], 2, "every class folder is empty", ["bundle"]),
    Hostile("one-empty-class-reported", [*_TRAIN, "--data", "local", "--no-apply"], 0,
            "green_triangle: empty class folder", ["bundle"]),
    # 6: non-UTF-8 names
    Hostile("non-utf8-name-json", ["infer", "--json", "imgs"], 1, "bad-\\\\xfe.png", ["bundle"]),
    # 7: malformed personalisation state
    Hostile("malformed-history-rollback", ["rollback"], 2, "malformed history[0] entry", ["bundle"]),
    Hostile("malformed-history-infer", ["infer", "img.jpg"], 2, "malformed history[0] entry", ["bundle"]),
    # 8: where no bundle is found, say where it looked and what to type
    Hostile("no-bundle-anywhere", ["infer", "img.jpg"], 2, "fedmvp-export --round N", ["img.jpg"]),
    # our own
    Hostile("bundle-is-a-file", ["infer", "img.jpg", "--bundle", "afile"], 2, "is a file", ["afile", "bundle"]),
    Hostile("rollback-nothing", ["rollback"], 1, "nothing to roll back", ["bundle"]),
    Hostile("image-is-a-directory", ["infer", "photo.jpg"], 1, "contains no image files", ["bundle"]),
    Hostile("unknown-class", ["train", "--data", "other"], 2, "unknown class 'zebra'", ["bundle"]),
    Hostile("class-folder-links-up", ["train", "--data", "local"], 2, "a link that leads back into", ["bundle"]),
    # a user's folder: the one walking rule (fedmvp_formats.folder_walk)
    Hostile("hard-link-across-classes", ["train", "--data", "local"], 2, "the same file as", ["bundle"]),
    Hostile("file-link-to-another-class", ["train", "--data", "local"], 2, "a link that leads back into", ["bundle"]),
    Hostile("fifo-in-class-folder", ["train", "--data", "local"], 2, "a FIFO (named pipe), not an image file",
            ["bundle"]),
    Hostile("escape-in-name-skipped", [*_TRAIN, "--data", "local", "--no-apply"], 0, "evil\\x1b[2J\\nname.png",
            ["bundle"]),
    Hostile("data-is-a-class-folder", ["train", "--data", "local/red_circle/../red_circle"], 2,
            "no class folders", ["bundle"]),
]
NEEDS_PERMISSIONS = {"out-read-only"}


@pytest.mark.parametrize("row", [
    pytest.param(r, id=r.id, marks=pytest.mark.skipif(
        r.id in NEEDS_PERMISSIONS and ROOT_IGNORES_PERMISSIONS,
        reason="running as root: chmod does not stop root writing (out-below-a-file simulates it)"))
    for r in ROWS])
def test_edge_client_hostile(row: Hostile, pristine_bundle: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("FEDMVP_BUNDLE", raising=False)
    shutil.copytree(pristine_bundle, tmp_path / "bundle")
    class_image(0, np.random.default_rng(3)).save(tmp_path / "img.jpg")
    write_local_data(tmp_path / "local", ["red_circle", "blue_square"], per_class=2)
    SETUPS[row.id](tmp_path)
    before = {p: tree_digest(tmp_path / p) for p in row.unchanged}
    try:
        done = run("edge-client", row.args, tmp_path)
    finally:
        if (tmp_path / "ro").exists():
            (tmp_path / "ro").chmod(0o700)
    assert_one_line_error(done, row.exit_code, row.fragment)
    assert "\x1b" not in done.stdout + done.stderr  # a file name's escape sequence never reaches the terminal raw
    for path in row.unchanged:
        after, expected = tree_digest(tmp_path / path), dict(before[path])
        if path == "bundle" and row.args[0] == "train" and row.exit_code == 0:
            # a written update names the device: its id is kept in the bundle from the first one on (never
            # drawn again once kept; a refused training keeps nothing)
            assert DEVICE_ID_FILE in after, "an update was written but the device's id was not kept"
            assert expected.get(DEVICE_ID_FILE, after[DEVICE_ID_FILE]) == after[DEVICE_ID_FILE]
            after.pop(DEVICE_ID_FILE)
            expected.pop(DEVICE_ID_FILE, None)
        assert after == expected, f"{path} changed"
        assert before[path], f"{path}: nothing to compare (the row's setup made no such path)"
