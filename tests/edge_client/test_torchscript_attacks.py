"""A compromised server's TorchScript module (docs/security.md): code that runs while it loads, entries a
traced module never has, operators that reach device files, methods beyond forward. Each is refused in
one line before torch runs it; the bundle's own module passes. The manifest is re-signed (forge.resign),
so every row reaches the check it attacks instead of stopping at a hash mismatch."""

from __future__ import annotations

import shutil
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from edge_client.bundle import read_bundle
from edge_client.torchscript_check import BundleError, check_archive, check_module
from fedmvp_apps.edge_cli import main
from tests.edge_client.test_torchscript_runtime import ts_bundle  # noqa: F401 (fixture)
from tests.hostile.forge import resign

MODEL = "model.torchscript.pt"


class ReadsAFile(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_file("/etc/hostname", shared=True, size=4, dtype=torch.uint8).float().sum() + x


class TwoMethods(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @torch.jit.export
    def other(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _saved(module: torch.nn.Module, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.script(module), str(path))
    return path


def _rewritten(source: Path, target: Path, edit) -> Path:
    """``source``'s entries copied to ``target``, each passed through ``edit(name, data)`` (None drops it)."""
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w") as out:
        for info in src.infolist():
            data = edit(info.filename, src.read(info))
            if data is not None:
                out.writestr(info.filename, data)
        extra = edit("", b"")
        if extra:
            out.writestr(*extra)
    return target


def _load_hook(name: str, data: bytes):
    # the EdgeClassifier's code file: edge_module.py, or edge_module/___torch_mangle_N.py after a second trace
    if "/code/__torch__/" in name and name.endswith(".py") and b"class EdgeClassifier" in data:
        return data + b"\n  def __setstate__(self, state):\n    pass\n"
    return None if name == "" else data


def _extra_entry(name: str, data: bytes):
    if name == "":
        prefix = "archive"
        return (f"{prefix}/payload.bin", b"\0" * 16)
    return data


def test_the_bundles_own_module_passes_both_checks(ts_bundle):
    path = ts_bundle / MODEL
    check_archive(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_module(path, torch.jit.load(str(path)))


@pytest.mark.parametrize("edit, says", [(_load_hook, "runs while the module loads"),
                                        (_extra_entry, "unexpected archive entry 'archive/payload.bin'")],
                         ids=["setstate", "extra-entry"])
def test_an_archive_is_refused_before_torch_reads_it(ts_bundle, tmp_path, edit, says):
    path = _rewritten(ts_bundle / MODEL, tmp_path / MODEL, edit)
    with pytest.raises(BundleError, match=says):
        check_archive(path)


@pytest.mark.parametrize("module, says", [(ReadsAFile(), "aten::from_file"), (TwoMethods(), "not only forward")],
                         ids=["from-file", "two-methods"])
def test_a_module_is_refused_before_it_runs(tmp_path, module, says):
    path = _saved(module, tmp_path / MODEL)
    check_archive(path)  # a scripted module's entries are a traced one's: what it calls is the tell
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(BundleError, match=says):
            check_module(path, torch.jit.load(str(path)))


def test_infer_refuses_a_served_module_that_reads_device_files_in_one_line(ts_bundle, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(ts_bundle, bundle)
    (bundle / MODEL).chmod(0o644)
    _saved(ReadsAFile(), bundle / MODEL)
    resign(bundle, MODEL)
    read_bundle(bundle)  # the manifest agrees with the file: the hash check cannot catch it
    image = bundle / "manifest.json"  # any path: the module is refused before an image is read
    out = CliRunner().invoke(main, ["infer", str(image), "--bundle", str(bundle), "--runtime", "torchscript"])
    assert out.exit_code == 2, out.output
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "aten::from_file" in lines[0] and "refusing to run it" in lines[0], out.stderr
