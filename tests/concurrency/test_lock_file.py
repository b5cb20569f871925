"""The lock file itself: never written through a link, never taken from another host silently.

A run's and a bundle's ``.lock`` planted as a symbolic link to a victim file outside: every command that
takes the lock refuses in one line naming it (exit 2) and the victim is untouched. Before, the lock was
opened following links and the victim truncated and overwritten with the holder's record.

A holder record naming ANOTHER host (a run or a bundle on a shared file system, where ``flock`` is local
to each host): the command refuses in one line (host, pid, since) and ``--break-lock`` takes it over with
a warning. Before, it was taken over with "that process is gone", which nothing here could know
(docs/security.md, "A lock held on another host").
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from fedmvp.runs import RunDir
from tests.concurrency.test_run_lock import updates  # noqa: F401 - the fixture
from tests.hostile.disk import assert_one_line_error, run

VICTIM = b"a file outside the run and the bundle\n"
ELSEWHERE = {"pid": 4242, "host": "build-node-7", "since": "2026-01-02T03:04:05Z", "command": "fedmvp ingest"}


@pytest.fixture
def run_dir(world, tmp_path) -> Path:
    shutil.copytree(world / "runs" / "moved", tmp_path / "run")
    return tmp_path / "run"


def _commands(world: Path, run_dir: Path, bundle: Path, update: Path) -> dict[str, tuple[str, list, Path]]:
    """Every command that takes a lock: (console script, arguments, the directory whose .lock it takes)."""
    return {
        "fedmvp ingest": ("fedmvp", ["ingest", "--run", run_dir, update], run_dir),
        "fedmvp train --resume": ("fedmvp", ["train", "--config", world / "preset.toml", "--run-dir", run_dir,
                                             "--resume"], run_dir),
        "edge-client train": ("edge-client", ["train", "--bundle", bundle, "--data", world / "local", "--out",
                                              bundle.parent / "u.safetensors"], bundle),
        "edge-client rollback": ("edge-client", ["rollback", "--bundle", bundle], bundle),
        "edge-client rollback --refresh": ("edge-client", ["rollback", "--refresh", "--bundle", bundle], bundle),
    }


COMMANDS = ["fedmvp ingest", "fedmvp train --resume", "edge-client train", "edge-client rollback",
            "edge-client rollback --refresh"]


@pytest.mark.parametrize("name", COMMANDS)
def test_a_lock_planted_as_a_link_is_refused_and_its_target_untouched(name, world, run_dir, bundle, updates,
                                                                      tmp_path):
    command, args, locked = _commands(world, run_dir, bundle, updates[0])[name]
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM)
    (locked / ".lock").symlink_to(victim)
    done = run(command, args, tmp_path, timeout=120)
    assert_one_line_error(done, 2, f"{locked / '.lock'}: a symbolic link (to {victim})")
    assert victim.read_bytes() == VICTIM and (locked / ".lock").is_symlink()
    assert RunDir(run_dir).rounds() == [1, 2] and not (bundle / "personalised").exists()


@pytest.mark.parametrize("name", COMMANDS)
def test_a_lock_of_another_host_is_refused_naming_it(name, world, run_dir, bundle, updates, tmp_path):
    command, args, locked = _commands(world, run_dir, bundle, updates[0])[name]
    record = json.dumps(ELSEWHERE)
    (locked / ".lock").write_text(record)
    done = run(command, args, tmp_path, timeout=120)
    assert_one_line_error(done, 2, f"{locked / '.lock'}: {'run' if locked == run_dir else 'bundle'} in use by "
                                   f"pid 4242 on build-node-7 since 2026-01-02T03:04:05Z (fedmvp ingest)")
    assert "--break-lock" in done.stderr and "taking over" not in done.stderr
    assert (locked / ".lock").read_text() == record  # left as it was: the operator decides
    assert RunDir(run_dir).rounds() == [1, 2] and not (bundle / "personalised").exists()


def test_break_lock_takes_another_hosts_lock_over_with_a_warning(run_dir, bundle, updates, tmp_path):
    (run_dir / ".lock").write_text(json.dumps(ELSEWHERE))
    done = run("fedmvp", ["ingest", "--break-lock", "--run", run_dir, updates[0]], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "taking over the lock of pid 4242 on build-node-7" in done.stderr and "--break-lock" in done.stderr
    assert RunDir(run_dir).rounds() == [1, 2, 3] and not (run_dir / ".lock").exists()

    (bundle / ".lock").write_text(json.dumps(ELSEWHERE))
    done = run("edge-client", ["rollback", "--break-lock", "--bundle", bundle], tmp_path)
    assert done.returncode == 1 and "nothing to roll back" in done.stderr  # it ran, under the lock it took over
    assert "taking over the lock of pid 4242 on build-node-7" in done.stderr
    assert not (bundle / ".lock").exists()


def test_serve_refuses_another_hosts_lock_before_it_starts_anything(world, run_dir, tmp_path, monkeypatch):
    """`fedmvp serve`'s ServerApp takes the lock in a process of its own: serve checks it first (exit 2),
    and with --break-lock takes it over and releases it before the SuperLink starts."""
    import fedmvp_apps.deploy.superlink as superlink

    started = []
    monkeypatch.setattr(superlink, "serve", lambda *a, **k: started.append(1) or "finished:completed")
    (run_dir / ".lock").write_text(json.dumps(ELSEWHERE))
    args = ["serve", "--config", world / "preset.toml", "--run-dir", run_dir, "--insecure"]
    done = run("fedmvp", args, tmp_path)
    assert_one_line_error(done, 2, f"{run_dir / '.lock'}: run in use by pid 4242 on build-node-7")
    assert started == [] and (run_dir / ".lock").exists()
    done = run("fedmvp", [*args, "--break-lock"], tmp_path)
    assert done.returncode == 0 and started == [1] and not (run_dir / ".lock").exists(), done.stderr[-3000:]


def test_join_refuses_another_hosts_bundle_lock_unless_broken(bundle):
    """`edge-client join` recovers the bundle before its SuperNode starts (``check_node``): another host's
    lock is refused there, in one line, or with --break-lock taken over and released."""
    from edge_client.bundle_lock import BundleBusy
    from edge_client.refresh import recover_refresh

    (bundle / ".lock").write_text(json.dumps(ELSEWHERE))
    with pytest.raises(BundleBusy, match="pid 4242 on build-node-7 since .*--break-lock"):
        recover_refresh(bundle)
    assert json.loads((bundle / ".lock").read_text()) == ELSEWHERE
    assert recover_refresh(bundle, break_lock=True) is None and not (bundle / ".lock").exists()


@pytest.mark.processes  # `fedmvp ingest --wait` as a real process
def test_wait_on_another_hosts_lock_says_so_and_goes_on_when_it_is_released(run_dir, updates, tmp_path):
    """--wait waits for the record to go (its holder releasing it), saying once whom it waits for."""
    from tests.concurrency.processes import finish, start, stderr_line

    (run_dir / ".lock").write_text(json.dumps(ELSEWHERE))
    waiting = start(["fedmvp", "ingest", "--wait", "--run", str(run_dir), str(updates[0])], tmp_path)
    line = stderr_line(waiting, "waiting:")
    assert "build-node-7" in line and "--break-lock" in line
    (run_dir / ".lock").unlink()  # the other host's holder ends
    done = finish(waiting)
    assert done.returncode == 0, done.stderr[-3000:]
    assert RunDir(run_dir).rounds() == [1, 2, 3]


if sys.platform == "win32":  # pragma: no cover - flock and symlinks are POSIX
    pytestmark = pytest.mark.skip("POSIX only")
