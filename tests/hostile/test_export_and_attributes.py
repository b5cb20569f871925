"""Hostile input for `fedmvp-export` and `fedmvp attributes generate/check`, as a user types it.

Every row runs the real console script in a subprocess and must end with the promised exit code,
one line naming the problem, no traceback, the API key nowhere, and the listed paths
byte-identical (tree_digest before and after). Servers are real local HTTP servers speaking the
OpenAI protocol (tests/openai_stub_server.py), scripted per class.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "export"))
from disk import Hostile, assert_one_line_error, run, tree_digest  # noqa: E402
from openai_stub_server import Reply, StubOpenAI, good, status  # noqa: E402

KEY = "sk-hostile-SECRET-9876543210"
PHRASES = [f"trait number {i}" for i in range(10)]


# ---- fedmvp-export ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def export_root(tmp_path_factory) -> Path:
    """A tiny run, a bundle of it that a device has used, a NaN round, and hostile attribute files."""
    from export_helpers import write_dataset, write_preset, write_run
    from safetensors.torch import load_file, save_file

    from export.bundle_writer import ExportOptions, export_bundle

    root = tmp_path_factory.mktemp("hostile-export")
    write_dataset(root / "data")
    write_preset(root / "preset.toml", root / "data")
    run_dir = root / "runs" / "r1"
    write_run(run_dir, root / "preset.toml")
    export_bundle(run_dir, 2, root / "bundle", ExportOptions(parity_images=32))
    (root / "bundle" / "personalised").mkdir()
    (root / "bundle" / "personalised" / "lora-0001.safetensors").write_bytes(b"device-trained")
    (root / "bundle" / "previous").mkdir()
    (root / "bundle" / "previous" / "lora.safetensors").write_bytes(b"before the refresh")

    nan_run = root / "runs" / "nan"
    shutil.copytree(run_dir, nan_run)
    path = nan_run / "round-0002" / "global.safetensors"
    tensors = load_file(str(path))
    tensors["promptformer.text_proj.weight"][0, 0] = float("nan")
    save_file(tensors, str(path))

    (root / "somefile").write_text("not a directory")
    (root / "notes").mkdir()
    (root / "notes" / "mine.txt").write_text("someone's folder")
    _attribute_files(root)
    return root


def _attribute_files(root: Path) -> None:
    """Attribute files an attacker (or an accident) hands over; shared by both tools."""
    (root / "list.json").write_text(json.dumps([["zebra", PHRASES]]))
    (root / "nonstring.json").write_text(json.dumps({"zebra": [1, 2, 3], "giraffe": PHRASES}))
    (root / "latin1.json").write_bytes('{"caf\u00e9": ["tasse"]}'.encode("latin-1"))
    (root / "unequal.json").write_text(json.dumps({"giraffe": PHRASES, "zebra": ["stripes"], "okapi": PHRASES}))
    big = {f"class {i}": [f"phrase {i} {j} " + "x" * 60 for j in range(10)] for i in range(14_000)}
    (root / "huge.json").write_text(json.dumps(big))
    assert (root / "huge.json").stat().st_size > 10_000_000


EXPORT_ROWS = [
    Hostile("force-over-device-state", ["--run", "{root}/runs/r1", "--out", "{root}/bundle", "--force"], 2,
            "--discard-device-state", ["bundle"]),
    Hostile("nan-checkpoint", ["--run", "{root}/runs/nan", "--out", "{root}/out"], 2,
            "round-0002/global.safetensors: tensor promptformer.text_proj.weight holds", ["runs"]),
    Hostile("unequal-phrase-counts", ["--run", "{root}/runs/r1", "--attributes", "{root}/unequal.json",
                                      "--out", "{root}/out"], 2, "'zebra' has 1", ["unequal.json"]),
    Hostile("out-is-the-run-itself", ["--run", "{root}/runs/r1", "--out", "{root}/runs/r1", "--force"], 2,
            "is not a bundle (no manifest.json)", ["runs"]),
    Hostile("out-is-a-parent-folder", ["--run", "{root}/runs/r1", "--out", "{root}/notes", "--force"], 2,
            "--force replaces only bundles", ["notes", "runs"]),
    Hostile("out-is-a-file", ["--run", "{root}/runs/r1", "--out", "{root}/somefile", "--force"], 2,
            "exists and is not a directory", ["somefile"]),
    Hostile("round-0", ["--run", "{root}/runs/r1", "--round", "0", "--out", "{root}/out"], 2, "round 0 not found"),
    Hostile("round-negative", ["--run", "{root}/runs/r1", "--round", "-1"], 2, "Invalid value for '--round'"),
    Hostile("round-huge", ["--run", "{root}/runs/r1", "--round", "99999999999999999999", "--out", "{root}/out"],
            2, "not found"),
    Hostile("run-is-a-file", ["--run", "{root}/somefile"], 2, "not a fedmvp run", ["somefile"]),
    Hostile("attributes-list", ["--run", "{root}/runs/r1", "--attributes", "{root}/list.json", "--out",
                                "{root}/out"], 2, "list.json: expected a JSON object", ["list.json"]),
    Hostile("attributes-nonstring", ["--run", "{root}/runs/r1", "--attributes", "{root}/nonstring.json", "--out",
                                     "{root}/out"], 2, "do not map to a list of strings: zebra"),
    Hostile("attributes-10mb", ["--run", "{root}/runs/r1", "--attributes", "{root}/huge.json", "--out",
                                "{root}/out"], 2, "too large for an attribute file"),
    Hostile("attributes-not-utf8", ["--run", "{root}/runs/r1", "--attributes", "{root}/latin1.json", "--out",
                                    "{root}/out"], 2, "latin1.json: cannot read attribute file"),
    Hostile("parity-images-0", ["--run", "{root}/runs/r1", "--parity-images", "0"], 2,
            "Invalid value for '--parity-images'"),
    Hostile("unknown-precision", ["--run", "{root}/runs/r1", "--precision", "int4"], 2,
            "Invalid value for '--precision'"),
]


@pytest.mark.parametrize("row", EXPORT_ROWS, ids=lambda r: r.id)
def test_export_refuses(export_root: Path, row: Hostile) -> None:
    before = {p: tree_digest(export_root / p) for p in row.unchanged}
    done = run("fedmvp-export", [a.format(root=export_root) for a in row.args], cwd=export_root)
    assert_one_line_error(done, row.exit_code, row.fragment)
    assert not (export_root / "out").exists()
    assert {p: tree_digest(export_root / p) for p in row.unchanged} == before
    assert not list(export_root.glob("*.tmp-*")) and not list(export_root.glob("*.old-*"))


def _staging_of(proc, out: Path, seconds: float = 120) -> Path:
    """The export's staging folder (OUT.tmp-PID-*), once it has one."""
    from tests.deadlines import scaled

    deadline = time.monotonic() + scaled(seconds)
    while not (found := list(out.parent.glob(f"{out.name}.tmp-{proc.pid}-*"))):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "the export made no staging folder"
        time.sleep(0.05)
    return found[0]


@pytest.mark.processes  # two real `fedmvp-export` processes, stopped mid-export
def test_a_stopped_export_writes_nothing_and_a_killed_ones_folder_goes_with_the_next(export_root: Path) -> None:
    """SIGTERM: one line, exit 143 within the stop bound, its staging folder removed and OUT not written;
    SIGKILL leaves the staging folder, which the next export of the same OUT removes with one line."""
    import os
    import signal
    import subprocess

    from tests.deadlines import scaled

    out = export_root / "stopped"
    command = [str(Path(sys.executable).parent / "fedmvp-export"), "--run", str(export_root / "runs" / "r1"),
               "--out", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    staging = _staging_of(proc, out)
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=scaled(30))
    assert proc.returncode == 143 and time.monotonic() - began < 15, err[-2000:]
    assert err.strip().splitlines()[-1] == ("error: stopped by SIGTERM: nothing was written (an existing bundle "
                                             "directory is as it was)")
    assert not staging.exists() and not out.exists() and "Traceback" not in err

    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    staging = _staging_of(proc, out)
    proc.kill()
    proc.wait(timeout=scaled(30))
    assert staging.exists() and not out.exists()  # killed outright: nothing could remove it
    done = run("fedmvp-export", ["--run", str(export_root / "runs" / "r1"), "--out", str(out)], cwd=export_root)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"warning: removed {staging}: the staging folder of an export (pid {proc.pid}) that was killed" \
        in done.stderr
    assert not staging.exists() and (out / "manifest.json").is_file()
    assert not list(export_root.glob("stopped.tmp-*"))


def test_export_discards_device_state_only_when_told_and_says_what(export_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    shutil.copytree(export_root / "bundle", out)
    done = run("fedmvp-export", ["--run", str(export_root / "runs" / "r1"), "--out", str(out), "--force",
                                 "--discard-device-state", "--parity-images", "32"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "discarded device state of the replaced bundle: personalised/, previous/" in done.stdout
    assert not (out / "personalised").exists() and (out / "manifest.json").is_file()


# ---- fedmvp attributes -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def attr_root(tmp_path_factory) -> Path:
    """Class lists, hostile attribute files, and an offline file for a 10,000-character class name."""
    from fedmvp.attributes.generate import GenerateConfig, generate_attributes

    root = tmp_path_factory.mktemp("hostile-attributes")
    (root / "classes.txt").write_text("giraffe\nzebra\n")
    (root / "one.txt").write_text("zebra\n")
    (root / "numbers.json").write_text("[1, 2]")
    (root / "long.json").write_text(json.dumps(["x" * 10_000, "giraffe"]))
    (root / "good.json").write_text(json.dumps({"giraffe": PHRASES, "zebra": PHRASES}))
    _attribute_files(root)
    generate_attributes(json.loads((root / "long.json").read_text()), root / "offline-long.json",
                        GenerateConfig(), offline=True, progress=False)
    return root


LEAKY = [good([f"stripes {KEY}", *PHRASES[1:]])] * 3  # a server echoing the key in every answer


# (row, the stub server's script or None for no server)
ATTRIBUTE_ROWS: list[tuple[Hostile, dict[str, list[Reply]] | None]] = [
    (Hostile("key-inside-every-answer", ["generate", "--classes", "{root}/one.txt", "--out", "{root}/out.json"],
             1, "contained the API key; it was dropped"), {"zebra": LEAKY}),
    pytest.param(Hostile("trickling-server", ["generate", "--classes", "{root}/one.txt", "--out", "{root}/out.json",
                                               "--timeout", "1", "--max-retries", "1"], 1, "no answer within 1s"),
                 {"zebra": [Reply("trickle", delay=0.3)] * 2}, marks=pytest.mark.timed),  # a wall-clock bound
    (Hostile("500-forever", ["generate", "--classes", "{root}/one.txt", "--out", "{root}/out.json",
                             "--timeout", "1", "--max-retries", "2"], 1, "HTTP 500; gave up after 3 attempts"),
     {"zebra": [status(500, f"upstream broke, key {KEY}")] * 10}),
    (Hostile("invalid-json-body", ["generate", "--classes", "{root}/one.txt", "--out", "{root}/out.json"], 1,
             "not valid JSON"), {"zebra": [Reply("bad_body")] * 10}),
    (Hostile("out-is-the-class-list", ["generate", "--classes", "{root}/classes.txt", "--out",
                                       "{root}/classes.txt", "--offline"], 2, "classes.txt: not valid JSON",
             ["classes.txt"]), None),
    (Hostile("out-is-a-directory", ["generate", "--classes", "{root}/classes.txt", "--out", "{root}",
                                    "--offline"], 2, "is a directory"), None),
    (Hostile("class-list-not-strings", ["generate", "--classes", "{root}/numbers.json", "--offline"], 2,
             "numbers.json: the JSON list must hold non-empty strings"), None),
    (Hostile("k-0", ["generate", "--classes", "{root}/classes.txt", "--k", "0", "--offline"], 2,
             "Invalid value for '--k'"), None),
    (Hostile("check-list", ["check", "{root}/list.json"], 2, "list.json: expected a JSON object",
             ["list.json"]), None),
    (Hostile("check-nonstring", ["check", "{root}/nonstring.json"], 2, "do not map to a list of strings"), None),
    (Hostile("check-not-utf8", ["check", "{root}/latin1.json"], 2, "cannot read attribute file"), None),
    (Hostile("check-10mb", ["check", "{root}/huge.json"], 2, "too large for an attribute file"), None),
    (Hostile("check-missing-class", ["check", "{root}/good.json", "--classes", "{root}/long.json"], 1,
             "1 classes missing"), None),
    (Hostile("check-offline-10000-char-name", ["check", "{root}/offline-long.json", "--classes",
                                               "{root}/long.json"], 0, "ok", ["offline-long.json"]), None),
]


@pytest.mark.parametrize("row,script", ATTRIBUTE_ROWS, ids=lambda r: getattr(r, "id", ""))
def test_attributes_refuses(attr_root: Path, row: Hostile, script: dict[str, list[Reply]] | None) -> None:
    before = {p: tree_digest(attr_root / p) for p in row.unchanged}
    env = {"OPENAI_API_KEY": KEY, "OPENAI_BASE_URL": ""}
    (attr_root / "out.json").unlink(missing_ok=True)
    started = time.monotonic()
    if script is None:
        done = run("fedmvp", ["attributes", *(a.format(root=attr_root) for a in row.args)], cwd=attr_root, env=env,
                   timeout=120)
    else:
        with StubOpenAI(script) as stub:
            args = [a.format(root=attr_root) for a in row.args]
            done = run("fedmvp", ["attributes", *args, "--base-url", stub.base_url, "--backoff", "0.01",
                                  "--no-progress"], cwd=attr_root, env=env, timeout=120)
    elapsed = time.monotonic() - started
    assert_one_line_error(done, row.exit_code, row.fragment)
    assert KEY not in done.stdout + done.stderr
    for path in attr_root.rglob("*"):
        assert not path.is_file() or KEY.encode() not in path.read_bytes(), path
    assert {p: tree_digest(attr_root / p) for p in row.unchanged} == before
    if row.id == "trickling-server":  # two tries of --timeout 1 s each, not the trickle's 100+ s
        assert elapsed < 15, elapsed
    if row.exit_code == 1 and script is not None:
        out = attr_root / "out.json"
        assert not out.exists() or "zebra" not in json.loads(out.read_text())
