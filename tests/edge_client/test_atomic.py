"""fedmvp_formats.atomic (the device's and every other atomic write): whole files or nothing, ordinary permissions, no temp files left behind."""

from __future__ import annotations

import os
import stat

import pytest

from fedmvp_formats import atomic


def test_write_and_copy_replace_whole_files(tmp_path):
    target = atomic.write_bytes(tmp_path / "sub" / "a.bin", b"first")
    assert target.read_bytes() == b"first"
    atomic.write_bytes(target, b"second, longer")
    assert target.read_bytes() == b"second, longer"
    copy = atomic.copy_file(target, tmp_path / "b.bin")
    assert copy.read_bytes() == b"second, longer"
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(copy.stat().st_mode) == 0o666 & ~mask  # not mkstemp's 0o600
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.bin", "b.bin", "sub"]


def test_a_failed_write_leaves_the_old_file(tmp_path):
    target = atomic.write_bytes(tmp_path / "a.bin", b"old")
    with pytest.raises(FileNotFoundError):
        atomic.copy_file(tmp_path / "missing", target)
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]
