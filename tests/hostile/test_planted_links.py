"""Links planted in a bundle, one table row each: a name the device writes (``.lock``, ``personalised/``, a
refresh's scratch, a temp file) made a symbolic link, a hard link or a FIFO aimed at a victim file OUTSIDE
the bundle. The real command runs; the victim must be byte for byte (and mode for mode) what it was, the
command says so in one line naming the file and exits 2, and nothing hangs (docs/security.md, "Links
planted in a run or a bundle").

Before: ``.lock`` was opened with ``O_RDWR | O_CREAT`` (following links), truncated and rewritten with the
holder's record, so `edge-client train`/`rollback` and `fedmvp-export --force` overwrote the victim.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "edge_client"))
from disk import assert_one_line_error, run  # noqa: E402
from edge_helpers import write_local_data  # noqa: E402

VICTIM = b"a file of the device that no command of a bundle may write\n"


def _symlink(root: Path) -> None:
    (root / "bundle" / ".lock").symlink_to(root / "victim")


def _hardlink(root: Path) -> None:
    os.link(root / "victim", root / "bundle" / ".lock")


def _fifo(root: Path) -> None:
    os.mkfifo(root / "bundle" / ".lock")


@dataclass(frozen=True)
class Planted:
    """One row: what is planted, the command (edge-client or fedmvp-export), and what it must say."""

    id: str
    plant: Callable[[Path], None]
    command: str
    args: list[str]
    fragment: str


LINK = "bundle/.lock: a symbolic link (to "
ROWS = [
    Planted("train-lock-symlink", _symlink, "edge-client",
            ["train", "--bundle", "bundle", "--data", "local", "--out", "u.safetensors", "--epochs", "1"], LINK),
    Planted("rollback-lock-symlink", _symlink, "edge-client", ["rollback", "--bundle", "bundle"], LINK),
    Planted("rollback-all-lock-symlink", _symlink, "edge-client", ["rollback", "--all", "--bundle", "bundle"], LINK),
    Planted("rollback-refresh-lock-symlink", _symlink, "edge-client",
            ["rollback", "--refresh", "--bundle", "bundle"], LINK),
    Planted("rollback-lock-hardlink", _hardlink, "edge-client", ["rollback", "--bundle", "bundle"],
            "bundle/.lock: a file with 2 names (a hard link to a file elsewhere)"),
    Planted("rollback-lock-fifo", _fifo, "edge-client", ["rollback", "--bundle", "bundle"], "bundle/.lock: a FIFO"),
]


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_a_link_planted_in_a_bundle_is_never_written_through(row: Planted, pristine_bundle: Path, tmp_path: Path):
    shutil.copytree(pristine_bundle, tmp_path / "bundle")
    write_local_data(tmp_path / "local", ["red_circle", "blue_square"], per_class=2)
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM)
    victim.chmod(0o600)
    row.plant(tmp_path)
    done = run(row.command, row.args, tmp_path, timeout=120)
    assert_one_line_error(done, 2, row.fragment)
    assert victim.read_bytes() == VICTIM and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert not (tmp_path / "u.safetensors").exists() and not (tmp_path / "bundle" / "personalised").exists()


def test_export_force_never_writes_through_a_planted_lock(pristine_bundle: Path, tmp_path: Path):
    """`fedmvp-export --force` takes the bundle lock of the directory it replaces: the same refusal, and
    the old bundle stays (the new one was built in a temp folder that goes)."""
    shutil.copytree(pristine_bundle, tmp_path / "bundle")
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM)
    _symlink(tmp_path)
    run_dir = pristine_bundle.parent / "runs" / "edgetest-1"
    done = run("fedmvp-export", ["--run", run_dir, "--round", "2", "--out", "bundle", "--force",
                                 "--parity-images", "32"], tmp_path, timeout=300)
    assert_one_line_error(done, 2, LINK)
    assert victim.read_bytes() == VICTIM and (tmp_path / "bundle" / ".lock").is_symlink()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _bundle_copy(pristine_bundle: Path, tmp_path: Path):
    from edge_client.bundle import read_bundle

    shutil.copytree(pristine_bundle, tmp_path / "bundle")
    return read_bundle(tmp_path / "bundle")


def test_personalised_linked_while_a_train_ran_is_refused_when_applying(pristine_bundle: Path, tmp_path: Path):
    """The bundle was checked when it was opened (``check_device_dirs``); a train lasts minutes, so the
    apply checks ``personalised/`` again under the lock: a link planted meanwhile receives nothing."""
    from edge_client.lora_store import PersonalisationError, apply_update_bytes
    from edge_client.update import update_bytes

    bundle = _bundle_copy(pristine_bundle, tmp_path)
    data = update_bytes({k: v + np.float32(0.01) for k, v in bundle.lora().items()}, bundle=bundle, num_examples=2,
                        mean_loss=1.0)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "lora-0009.safetensors").write_bytes(VICTIM)
    (tmp_path / "bundle" / "personalised").symlink_to(elsewhere)
    with pytest.raises(PersonalisationError, match="bundle/personalised: a symbolic link"):
        apply_update_bytes(bundle, data)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["lora-0009.safetensors"]
    assert (elsewhere / "lora-0009.safetensors").read_bytes() == VICTIM


def test_a_refresh_scratch_directory_planted_as_a_link_is_removed_not_followed(pristine_bundle: Path,
                                                                               tmp_path: Path):
    """A refresh empties its scratch directories first; one that is a link goes (the link only), and the
    refresh then stages its files inside the bundle. Before, the link stayed and the refresh crashed."""
    from safetensors.numpy import load_file

    from fedmvp_formats.bundle_manifest import REFRESH_NEW

    from edge_client.bundle import read_bundle
    from edge_client.refresh import promptformer_digest, refresh_bundle

    bundle = _bundle_copy(pristine_bundle, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_bytes(VICTIM)
    (tmp_path / "bundle" / REFRESH_NEW).symlink_to(elsewhere)
    tensors = load_file(pristine_bundle.parent / "runs" / "edgetest-1" / "round-0002" / "global.safetensors")
    tensors = {k: v + np.float32(0.01) for k, v in tensors.items() if k.startswith("promptformer.")}
    refresh_bundle(bundle, tensors, digest=promptformer_digest(tensors), round_number=3)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep"] and (elsewhere / "keep").read_bytes() == VICTIM
    assert read_bundle(tmp_path / "bundle").round == 3 and not (tmp_path / "bundle" / REFRESH_NEW).exists()


def test_a_temp_file_swapped_for_a_link_while_written_is_refused(tmp_path: Path):
    """The atomic writers write, fsync and chmod the temp file through the descriptor that created it
    (``O_EXCL | O_NOFOLLOW``) and rename it only while its name is still that file. Before, the temp was
    reopened by name: a link swapped in meanwhile had its target chmodded and became the written file."""
    from fedmvp_formats import atomic

    victim, target = tmp_path / "victim", tmp_path / "state.json"
    victim.write_bytes(VICTIM)
    victim.chmod(0o600)
    with pytest.raises(OSError, match="replaced while it was written"):
        with atomic.replacing(target, mode=0o644) as handle:
            handle.write(b"{}\n")
            (temp,) = tmp_path.glob(".state.json.*.tmp")
            temp.unlink()
            temp.symlink_to(victim)
    assert victim.read_bytes() == VICTIM and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert not target.exists() and not target.is_symlink()


def test_a_link_at_the_target_is_replaced_and_its_target_mode_not_copied(tmp_path: Path):
    """Renaming over a link replaces the link; the new file gets a new file's mode, not the victim's."""
    from fedmvp_formats import atomic

    victim, target = tmp_path / "victim", tmp_path / "metrics.csv"
    victim.write_bytes(VICTIM)
    victim.chmod(0o700)
    target.symlink_to(victim)
    atomic.write_text(target, "round\n")
    assert not target.is_symlink() and target.read_text() == "round\n"
    assert stat.S_IMODE(target.stat().st_mode) == atomic.new_file_mode()
    assert victim.read_bytes() == VICTIM and stat.S_IMODE(victim.stat().st_mode) == 0o700


def test_a_round_directory_planted_as_a_link_is_replaced_not_followed(tmp_path: Path):
    """A checkpoint round is written in a temp folder renamed over ``round-NNNN``: a link there goes (the
    link only: nothing is written or deleted through it), and no ``.round-NNNN.old-*`` is left behind."""
    from fedmvp_formats import atomic

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "global.safetensors").write_bytes(VICTIM)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "round-0003").symlink_to(elsewhere)
    with atomic.atomic_dir(tmp_path / "run" / "round-0003") as folder:
        (folder / "state.json").write_text("{}\n")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["round-0003"]
    assert not (tmp_path / "run" / "round-0003").is_symlink()
    assert sorted(p.name for p in elsewhere.iterdir()) == ["global.safetensors"]
    assert (elsewhere / "global.safetensors").read_bytes() == VICTIM
