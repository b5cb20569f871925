"""Hostile-input fixes of edge_client, in process: write targets, concurrent personalisation,
manifest integrity, update metadata, local data, non-UTF-8 names, malformed state."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from edge_helpers import tree_bytes, write_local_data

from edge_client.bundle import read_bundle
from edge_client.train import train_local
from edge_client.train_options import TrainInputError
from tests.deadlines import scaled

LOCAL_CLASSES = ["purple_cross", "orange_ring"]


@pytest.fixture
def local(tmp_path) -> Path:
    return write_local_data(tmp_path / "local", LOCAL_CLASSES, per_class=2)


# ---- 1: no output inside a bundle or run, no overwriting ------------------------------------------------
@pytest.mark.parametrize("where", ["weights.safetensors", "personalised/x.safetensors", "sub/dir"])
def test_out_inside_a_bundle_is_refused_before_training(bundle_dir, local, where):
    before = tree_bytes(bundle_dir)
    with pytest.raises(TrainInputError, match="inside a fedmvp bundle"):
        train_local(local, bundle_dir, out=bundle_dir / where, epochs=1)
    assert tree_bytes(bundle_dir) == before


def test_out_through_a_symlink_into_a_bundle_is_refused(bundle_dir, local, tmp_path):
    (tmp_path / "link").symlink_to(bundle_dir)
    with pytest.raises(TrainInputError, match="inside a fedmvp bundle"):
        train_local(local, bundle_dir, out=tmp_path / "link" / "u.safetensors", epochs=1)


def test_out_inside_a_run_directory_is_refused(bundle_dir, local, edge_run):
    with pytest.raises(TrainInputError, match="inside a fedmvp run directory"):
        train_local(local, bundle_dir, out=edge_run / "updates", epochs=1)


def test_existing_out_file_is_never_overwritten(bundle_dir, local, tmp_path):
    target = tmp_path / "mine.safetensors"
    target.write_bytes(b"precious")
    with pytest.raises(TrainInputError, match="already exists"):
        train_local(local, bundle_dir, out=target, epochs=1)
    assert target.read_bytes() == b"precious"


# ---- 2: concurrent personalisation --------------------------------------------------------------------
_APPLY = """
import sys
from edge_client.bundle import read_bundle
from edge_client.lora_store import apply_update
bundle = read_bundle(sys.argv[1])
for path in sys.argv[2:]:
    apply_update(bundle, path, keep=1000)
"""


@pytest.mark.processes
def test_concurrent_applies_lose_nothing_and_every_entry_verifies(bundle_dir, tmp_path):
    import subprocess
    import sys

    import numpy as np

    from edge_client.lora_store import _load_entry, read_state
    from edge_client.update import write_update

    bundle = read_bundle(bundle_dir)
    base = bundle.lora()
    workers, each = 4, 4
    batches = []
    for w in range(workers):
        paths = []
        for i in range(each):
            tensors = {k: v + np.float32(0.001 * (w * each + i + 1)) for k, v in base.items()}
            paths.append(str(write_update(tmp_path / f"u{w}-{i}.safetensors", tensors, bundle=bundle,
                                          num_examples=1, mean_loss=1.0)))
        batches.append(paths)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", _APPLY, str(bundle_dir), *paths], env=env,
                              stderr=subprocess.PIPE, text=True) for paths in batches]
    for proc in procs:
        _, err = proc.communicate(timeout=scaled(300))
        assert proc.returncode == 0, err[-2000:]
    state = read_state(bundle)
    entries = [state["active"], *state["history"]]
    assert len(entries) == workers * each and state["next"] == workers * each + 1
    assert len({e["file"] for e in entries}) == workers * each
    assert sorted(Path(e["update"]["source"]).name for e in entries) == sorted(
        Path(p).name for paths in batches for p in paths)
    for entry in entries:
        _load_entry(bundle, entry)  # size, sha256, update metadata
    leftovers = [p.name for p in (bundle_dir / "personalised").iterdir() if p.name.endswith(".tmp")]
    assert not leftovers


# ---- 3: manifest integrity ----------------------------------------------------------------------------
def _edit_manifest(bundle_dir: Path, change) -> None:
    manifest = json.loads((bundle_dir / "manifest.json").read_text())
    change(manifest)
    (bundle_dir / "manifest.json").write_text(json.dumps(manifest))


def _swap(m: dict) -> None:
    names = m["classes"]["names"]
    names[0], names[1] = names[1], names[0]


@pytest.mark.parametrize("change, field", [
    (_swap, "classes.names"),
    (lambda m: m["classes"].update(names=m["classes"]["names"][:-1]), "classes.count"),
    (lambda m: m["classes"].update(names=m["classes"]["names"][:-1], count=m["classes"]["count"] - 1),
     "onnx.num_classes"),
    (lambda m: m["classes"].update(names=[m["classes"]["names"][0]] * m["classes"]["count"]), "classes.names"),
    (lambda m: m["classes"].update(names=[1, 2, 3, 4, 5, 6]), "classes.names"),
    (lambda m: m.update(classes=["a", "b"]), "classes"),
    (lambda m: m.update(preprocess=[224]), "preprocess"),
    (lambda m: m["preprocess"].update(image_size="big"), "preprocess"),
    (lambda m: m["lora"].update(tensors=["x"]), "lora.tensors"),
    (lambda m: m.update(source=[1]), "source"),
    (lambda m: m.update(precision=7), "precision"),
    (lambda m: m.update(files_by_role={"onnx": "nope"}), "files_by_role"),
])
def test_inconsistent_manifest_is_one_line_naming_the_field(bundle_dir, change, field):
    from edge_client.bundle import BundleError

    _edit_manifest(bundle_dir, change)
    with pytest.raises(BundleError) as err:
        read_bundle(bundle_dir)
    message = str(err.value)
    assert "manifest.json" in message and f"field {field}" in message and "\n" not in message


def test_model_pins_the_class_list_and_info_says_so(edge_bundle):
    from edge_client.bundle import classes_digest, onnx_classes_pin
    from edge_client.device import bundle_report

    bundle = read_bundle(edge_bundle)
    assert onnx_classes_pin(bundle.file("onnx")) == classes_digest(bundle.class_names)
    assert bundle.manifest["onnx"]["num_classes"] == len(bundle.class_names)
    assert bundle_report(edge_bundle)["classes_pinned"] is True


# ---- 4: update weight and loss ------------------------------------------------------------------------
@pytest.mark.parametrize("key, value, fragment", [
    ("num_examples", "0", "num_examples '0'"), ("num_examples", "-3", "num_examples '-3'"),
    ("mean_loss", "nan", "mean_loss 'nan'"), ("mean_loss", "inf", "mean_loss 'inf'"),
    ("final_loss", "-inf", "final_loss '-inf'")])
def test_update_without_weight_or_with_a_non_finite_loss_is_refused(edge_bundle, tmp_path, key, value, fragment):
    from safetensors.numpy import load_file, save_file

    from edge_client.update import UpdateError, read_update, write_update

    bundle = read_bundle(edge_bundle)
    good = write_update(tmp_path / "good.safetensors", bundle.lora(), bundle=bundle, num_examples=3, mean_loss=1.0,
                        final_loss=1.0)
    from fedmvp_formats.update import raw_metadata as _read_metadata

    metadata = {**_read_metadata(good.read_bytes()), key: value}
    bad = tmp_path / "bad.safetensors"
    save_file(load_file(str(good)), str(bad), metadata=metadata)
    with pytest.raises(UpdateError, match=fragment):
        read_update(bad, bundle)
    with pytest.raises(UpdateError):
        write_update(tmp_path / "never.safetensors", bundle.lora(), bundle=bundle, num_examples=0, mean_loss=1.0)
    assert not (tmp_path / "never.safetensors").exists()


# ---- 5: empty class folders ---------------------------------------------------------------------------
def test_empty_class_folder_is_reported_and_all_empty_is_an_error(tmp_path):
    from edge_client.local_data import scan_folder
    from edge_helpers import CLASSES

    data = write_local_data(tmp_path / "data", ["red_circle"], per_class=1)
    (data / "blue_square").mkdir()
    dataset = scan_folder(data, CLASSES)
    assert any("blue_square" in line and "empty class folder" in line for line in dataset.skipped)
    shutil.rmtree(data / "red_circle")
    (data / "red_circle").mkdir()
    with pytest.raises(TrainInputError, match="every class folder is empty"):
        scan_folder(data, CLASSES)


# ---- 6: non-UTF-8 file names --------------------------------------------------------------------------
@pytest.mark.processes
def test_infer_json_and_table_stay_valid_utf8_with_non_utf8_names(edge_bundle, tmp_path):
    import subprocess
    import sys

    from PIL import Image

    folder = tmp_path / "imgs"
    folder.mkdir()
    raw = os.path.join(os.fsencode(folder), b"caf\xe9-\xff.png")
    Image.new("RGB", (20, 20), (200, 30, 30)).save(os.fsdecode(raw), format="PNG")
    with open(os.path.join(os.fsencode(folder), b"bad-\xfe.png"), "wb") as handle:
        handle.write(b"not an image")
    cli = Path(sys.executable).parent / "edge-client"
    for extra in (["--json"], []):
        done = subprocess.run([str(cli), "infer", "--bundle", str(edge_bundle), "--provider", "cpu", *extra,
                               str(folder)], capture_output=True, timeout=scaled(300))
        out, err = done.stdout.decode("utf-8"), done.stderr.decode("utf-8")  # strict: valid UTF-8
        assert done.returncode == 1 and "Traceback" not in out + err, out + err
        if extra:
            rows = [json.loads(line) for line in out.splitlines()]
            good = next(r for r in rows if "top_k" in r)
            assert bytes.fromhex(good["path_bytes"]) == raw and good["path"].endswith("caf\\xe9-\\xff.png")
            assert any(r.get("path", "").endswith("bad-\\xfe.png") and "error" in r for r in rows)
        else:
            assert "caf\\xe9-\\xff.png" in out and "bad-\\xfe.png" in err


# ---- 7: malformed state, unwritable targets -----------------------------------------------------------
@pytest.mark.parametrize("history", [["lora-0001.safetensors"], [{"file": 3}], [{"file": "../x", "sha256": "a"}],
                                     [{"file": "lora-0001.safetensors", "sha256": "a", "bytes": "9"}], [None]])
def test_malformed_history_entry_is_one_line_for_infer_and_rollback(bundle_dir, history):
    from click.testing import CliRunner

    from fedmvp_apps.edge_cli import main

    bundle = read_bundle(bundle_dir)
    state = bundle_dir / "personalised" / "state.json"
    state.parent.mkdir()
    state.write_text(json.dumps({"format": "fedmvp-edge-personalisation", "format_version": 1,
                                 "bundle_id": bundle.id, "active": None, "history": history, "next": 2}))
    for args in (["rollback"], ["infer", "nothing.png"], ["info"]):
        done = CliRunner().invoke(main, [*args, "--bundle", str(bundle_dir)])
        assert done.exit_code == 2, done.output
        assert done.exception is None or isinstance(done.exception, SystemExit)
        assert "state.json: malformed history[0] entry" in done.output
    assert CliRunner().invoke(main, ["rollback", "--all", "--bundle", str(bundle_dir)]).exit_code == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_out_directory_is_refused_before_training(bundle_dir, local, tmp_path):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o500)
    try:
        with pytest.raises(TrainInputError, match="cannot write the update file"):
            train_local(local, bundle_dir, out=out, epochs=1)
    finally:
        out.chmod(0o700)


def test_out_below_a_file_is_refused_before_training(bundle_dir, local, tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(TrainInputError, match="not a directory"):
        train_local(local, bundle_dir, out=tmp_path / "afile" / "sub", epochs=1)


def test_a_full_disk_while_writing_is_one_line_and_leaves_nothing(bundle_dir, local, tmp_path, monkeypatch):
    import errno

    import edge_client.train as train_module
    from edge_client.train_options import TrainingError

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(train_module, "write_bytes", full)  # the update file's write
    before = tree_bytes(bundle_dir)
    with pytest.raises(TrainingError, match="No space left on device"):
        train_local(local, bundle_dir, out=tmp_path / "u", epochs=1, batch_size=2)
    assert tree_bytes(bundle_dir) == before and not (tmp_path / "u").exists()
