"""The product's own commands, typed verbatim one after the other in a fresh project directory."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from edge_helpers import class_image, write_local_data
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hostile"))
from disk import assert_one_line_error, run  # noqa: E402


def test_export_then_infer_then_train_in_one_directory(edge_run, tmp_path, monkeypatch):
    monkeypatch.delenv("FEDMVP_BUNDLE", raising=False)
    project = tmp_path / "project"
    shutil.copytree(edge_run, project / "runs" / edge_run.name)
    class_image(0, np.random.default_rng(5)).save(project / "img.jpg")
    write_local_data(project / "local", ["red_circle", "blue_square"], per_class=2)

    missing = run("edge-client", ["infer", "img.jpg"], project)
    assert_one_line_error(missing, 2, "fedmvp-export --round N")
    assert "$FEDMVP_BUNDLE" in missing.stderr and "./bundle" in missing.stderr

    done = run("fedmvp-export", ["--round", "2"], project)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "./bundle -> runs/edgetest-1/bundles/round-0002-fp32" in done.stdout
    assert (project / "bundle").is_symlink() and (project / "bundle" / "manifest.json").is_file()

    done = run("edge-client", ["infer", "img.jpg"], project)
    assert done.returncode == 0, done.stdout + done.stderr
    done = run("edge-client", ["train", "--data", "local/"], project)
    assert done.returncode == 0, done.stdout + done.stderr
    assert list((project / "updates").glob("update-r0002-*.safetensors"))


def test_a_bundle_of_ones_own_is_never_replaced(tmp_path):
    from export.bundle_writer import point_default_bundle

    target = tmp_path / "runs" / "r" / "bundles" / "round-0001-fp32"
    target.mkdir(parents=True)
    (tmp_path / "bundle").mkdir()
    (tmp_path / "bundle" / "mine").write_text("keep")
    line = point_default_bundle(target, tmp_path)
    assert "left as it is" in line and (tmp_path / "bundle" / "mine").read_text() == "keep"
    (tmp_path / "bundle" / "mine").unlink()
    (tmp_path / "bundle").rmdir()
    (tmp_path / "bundle").symlink_to("elsewhere")
    assert point_default_bundle(target, tmp_path).startswith("./bundle -> runs/r/bundles/round-0001-fp32")
    assert (tmp_path / "bundle").resolve() == target.resolve()
