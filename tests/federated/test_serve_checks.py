"""What `fedmvp serve` and `fedmvp join` refuse before they start anything
(docs/tutorials/across-machines.md, "Checked before anything starts"):
a port something already listens on, and, for a run that exists, another --rounds or another preset.
Each: one line naming the problem, exit 2, within seconds, nothing started or written. The same
preset by another path is the same preset (the lifecycle test resumes a run that way).
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.deadlines import scaled
from tests.federated.conftest import write_preset
from tests.federated.processes import ENV, FEDMVP

pytestmark = pytest.mark.processes  # refusals of `fedmvp serve`/`join` (exit 2): no federation starts


def _run(args: list[str], cwd: Path) -> tuple[int, list[str], float]:
    started = time.monotonic()
    done = subprocess.run([*FEDMVP, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=scaled(120))
    return done.returncode, done.stderr.strip().splitlines(), time.monotonic() - started


@pytest.fixture
def listener():
    """A port something listens on (another program, or a SuperLink left running)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture
def prepared(tmp_path, small_world) -> tuple[Path, Path]:
    """A run of 3 rounds that exists (config.json written), and its preset."""
    from fedmvp.federated.prepare import prepare_run

    preset = write_preset(tmp_path, small_world)
    run = prepare_run(str(preset), str(tmp_path / "runs" / "r"), 3, resume=False, device="cpu", with_data=False)
    return preset, run.path


def test_serve_on_a_port_in_use_names_it_and_exits_2_at_once(tmp_path, listener, prepared):
    from fedmvp_apps.deploy.certs import write_certs

    preset, run = prepared
    certs = write_certs(tmp_path / "certs", nodes=1)
    (tmp_path / "elsewhere").mkdir()
    copy = tmp_path / "elsewhere" / "same.toml"  # the run's preset by another path: no complaint about it
    copy.write_text(preset.read_text())
    code, lines, took = _run(["serve", "--config", str(copy), "--run-dir", str(run), "--certs", str(certs.out),
                              "--node-keys", str(certs.node_list), "--address", f"127.0.0.1:{listener}"], tmp_path)
    assert code == 2 and len(lines) == 1 and f"127.0.0.1:{listener}: already in use" in lines[0], lines
    assert took < 30  # the interpreter's start; it was 34 s of waiting, then an unrelated error
    assert not (run.parent / f".{run.name}.flwr").exists() and not (run.parent / f"{run.name}.superlink.log").exists()


def test_join_on_a_local_port_in_use_names_it_and_exits_2(tmp_path, listener, prepared):
    preset, _ = prepared
    code, lines, _ = _run(["join", "--superlink", "127.0.0.1:9", "--config", str(preset), "--site", "0",
                           "--root-certificates", str(preset), "--port", str(listener)], tmp_path)
    assert code == 2 and len(lines) == 1 and f"--port 127.0.0.1:{listener}: already in use" in lines[0], lines


@pytest.mark.parametrize("change,fragment", [
    (lambda preset: ["--rounds", "5"], "was started with 3 rounds, not --rounds 5"),
    (lambda preset: ["--config", str(_edited(preset))], "not the preset"),
], ids=["rounds", "preset"])
def test_serve_on_an_existing_run_refuses_another_rounds_or_preset_before_starting(tmp_path, prepared, change,
                                                                                   fragment):
    preset, run = prepared
    args = ["serve", "--config", str(preset), "--run-dir", str(run), "--insecure", "--address", "127.0.0.1:9"]
    extra = change(preset)
    if extra[0] == "--config":
        args[2] = extra[1]
        extra = []
    code, lines, _ = _run([*args, *extra], tmp_path)
    assert code == 2 and len(lines) == 1 and fragment in lines[0], lines
    assert "Traceback" not in "\n".join(lines)
    assert not (run.parent / f".{run.name}.flwr").exists()  # nothing started


def _edited(preset: Path) -> Path:
    other = preset.parent / "other.toml"
    other.write_text(preset.read_text().replace("seed = 3", "seed = 4"))
    return other


def test_serve_of_a_site_bound_to_a_key_that_is_no_public_key_names_it_and_exits_2(tmp_path, small_world):
    """A [[sites]] node_key (docs/security.md) is read before anything starts: a missing file or one that is
    no OpenSSH public key is one line naming it, exit 2, no run written."""
    from tests.site_trees import site_preset, world_classes

    seen, _ = world_classes(small_world)
    preset = site_preset(tmp_path, small_world, {"north": seen[:2]}, [], rounds=1)
    preset.write_text(preset.read_text() + 'node_key = "keys/north.pub"\n')  # the last [[sites]] table's
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "north.pub").write_text("ssh-rsa nonsense\n")
    code, lines, _ = _run(["serve", "--config", str(preset), "--run-dir", "runs/bound", "--insecure"], tmp_path)
    assert code == 2 and len(lines) == 1 and "north.pub: node_key is not an OpenSSH public key" in lines[0], lines
    assert not (tmp_path / "runs" / "bound").exists()
