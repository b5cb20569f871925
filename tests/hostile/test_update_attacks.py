"""Update files as an attacker writes them: `fedmvp ingest` and the device's own reader refuse each one.

One row per attack: the file's bytes (headers written by hand where the writer would refuse), the
fragment of the one reason line `fedmvp ingest --run RUN FILE` prints, and the fragment of the
`UpdateError` the device's reader (`edge_client.update.read_update`) raises, None where the check
is the server's alone (the run's identity and rounds). A refused file must leave the run's bytes
as they were, exit 1, and show one printable, bounded line: nothing the attacker wrote (newlines,
ANSI escapes, megabytes) reaches the terminal raw. The run is tests/run_fixtures.py's (rounds 1
and 2, LoRA rank 4), built once; rows run the command in process.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from disk import run, tree_digest  # noqa: E402
from tests.federated.test_ingest import (PROMPTFORMERS, RUN_ID, SERVER, bundle_for, configure,  # noqa: E402
                                         lora_of, round_promptformer, round_state)

META = {"format": "fedmvp-edge-update", "format_version": "1", "bundle_id": "0" * 64, "bundle_round": "2",
        "num_examples": "10", "mean_loss": "1.0", "created": "2025-01-01T00:00:00Z", "run_id": RUN_ID}
ANSI = "\x1b[31m\nFAKE accepted\x1b[0m\r"
MAX_REASON = 300  # the longest reason a row may print (the cap in the code is smaller)
Lora = dict[str, np.ndarray]


def blob(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    """A safetensors file by hand: 8-byte little-endian header length, header, data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(raw) if length is None else length).to_bytes(8, "little") + raw + data


def parts(lora: Lora, dtype: str = "F32", names: dict[str, str] | None = None,
          **meta: object) -> tuple[dict, bytes]:
    """Header and data of an update holding ``lora`` (as ``dtype``), metadata META | ``meta``
    (a None value leaves the key out; any other value is written as given, also non-strings)."""
    numpy_dtype = {"F32": "<f4", "F64": "<f8", "I64": "<i8", "F16": "<f2", "BF16": "<u2"}[dtype]
    header: dict = {"__metadata__": {k: v for k, v in (META | meta).items() if v is not None}}
    data, offset = b"", 0
    for name in sorted(lora):
        chunk = lora[name].astype(numpy_dtype).tobytes()
        header[(names or {}).get(name, name)] = {"dtype": dtype, "shape": list(lora[name].shape),
                                                 "data_offsets": [offset, offset + len(chunk)]}
        data, offset = data + chunk, offset + len(chunk)
    return header, data


def update(lora: Lora, dtype: str = "F32", **meta: object) -> bytes:
    return blob(*parts(lora, dtype, **meta))


def past_the_end(lora: Lora) -> bytes:
    header, data = parts(lora)
    raw = json.dumps(header).encode()
    return blob(raw, data, length=len(raw) + len(data) + 1)


def overlapping(lora: Lora) -> bytes:
    header, data = parts(lora)
    first, second = sorted(lora)[:2]
    header[second]["data_offsets"] = header[first]["data_offsets"]  # two tensors, one range
    return blob(header, data)


def terabytes(lora: Lora) -> bytes:
    header, data = parts(lora)
    header[sorted(lora)[0]]["shape"] = [2 ** 20, 2 ** 20]  # 4 TiB of float32 declared, 2 KiB given
    return blob(header, data)


def renamed(lora: Lora, new: str) -> bytes:
    return blob(*parts(lora, names={sorted(lora)[0]: new}))


def duplicate_metadata(lora: Lora) -> bytes:
    header, data = parts(lora)
    text = json.dumps(header)
    evil = json.dumps({**META, "num_examples": "99"})
    return blob(text[:-1].encode() + b', "__metadata__": ' + evil.encode() + b"}", data)


def edited(lora: Lora, old: str, new: str) -> bytes:
    """An update whose header text has ``old`` replaced by ``new`` once (raw JSON, any type)."""
    header, data = parts(lora)
    return blob(json.dumps(header).replace(old, new, 1).encode(), data)


def nested(lora: Lora) -> bytes:
    return blob(b'{"__metadata__": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", parts(lora)[1])


@dataclass(frozen=True)
class Attack:
    """One hostile file: its bytes, the ingest reason fragment, the device reader's (None: n/a)."""

    id: str
    make: Callable[[Lora], bytes]
    reason: str
    edge: str | None
    accepted: bool = False


def _num(value: str) -> Attack:
    return Attack(f"num_examples={value[:12]!r}", lambda lora: update(lora, num_examples=value),
                  "is not a positive integer", "num_examples")


ATTACKS = [
    # the safetensors container
    Attack("header-length-2**63", lambda lora: blob(*parts(lora), length=2 ** 63 - 1), "header length", "header length"),
    Attack("header-length-past-the-end", lambda lora: past_the_end(lora), "header length", "header length"),
    Attack("overlapping-offsets", overlapping, "not a safetensors file", "not a safetensors file"),
    Attack("terabyte-shape", terabytes, "not a safetensors file", "not a safetensors file"),
    Attack("float64", lambda lora: update(lora, "F64"), "not float32", "not float32"),
    Attack("int64", lambda lora: update(lora, "I64"), "not float32", "not float32"),
    Attack("bfloat16", lambda lora: update(lora, "BF16"), "not float32", "not float32"),
    Attack("float16", lambda lora: update(lora, "F16"), "not float32", "not float32"),
    Attack("header-not-json", lambda lora: blob(b"{not json at all}", parts(lora)[1]), "header is not valid JSON",
           "header is not valid JSON"),
    Attack("header-nested-100000-deep", nested, "header is not valid JSON", "header is not valid JSON"),
    Attack("header-a-list", lambda lora: blob(b"[1, 2]"), "header is not a JSON object", "header is not a JSON object"),
    Attack("empty-file", lambda lora: b"", "too short", "too short"),
    Attack("8-byte-file", lambda lora: (0).to_bytes(8, "little"), "header length 0", "header length 0"),
    Attack("duplicate-metadata-key", duplicate_metadata, "duplicate key '__metadata__'", "duplicate key"),
    # metadata injection
    Attack("metadata-number", lambda lora: update(lora, format_version=1),
           "metadata format_version is not a string (int)", "is not a string (int)"),
    Attack("metadata-list", lambda lora: update(lora, num_examples=[10]), "is not a string (list)", "not a string"),
    Attack("metadata-object", lambda lora: update(lora, created={"y": 2025}), "is not a string (dict)", "not a string"),
    Attack("metadata-null", lambda lora: edited(lora, '"mean_loss": "1.0"', '"mean_loss": null'),
           "metadata mean_loss is not a string (NoneType)", "is not a string"),
    Attack("metadata-4MB-value", lambda lora: update(lora, device="x" * (4 << 20)), "bytes, more than the",
           "bytes, more than the"),
    Attack("metadata-1MiB-value-no-tensors", lambda lora: blob({"__metadata__": {**META, "device": "x" * (1 << 20)}}),
           "header length", "header length"),
    Attack("metadata-900KB-format", lambda lora: update(lora, format="y" * 900_000), "not a fedmvp-edge-update file",
           "not a fedmvp-edge-update file"),
    Attack("ansi-in-format", lambda lora: update(lora, format=ANSI), "not a fedmvp-edge-update file",
           "not a fedmvp-edge-update file"),
    Attack("ansi-in-version", lambda lora: update(lora, format_version=f"1{ANSI}"), "is not supported", "format_version"),
    Attack("ansi-in-bundle-id", lambda lora: update(lora, bundle_id="0" * 60 + ANSI), "is not a sha256", None),
    Attack("ansi-in-bundle-round", lambda lora: update(lora, bundle_round=ANSI), "is not a round number",
           "bundle_round"),
    Attack("ansi-in-created", lambda lora: update(lora, created=ANSI), "is not an ISO 8601 time", None),
    Attack("ansi-in-images-digest", lambda lora: update(lora, images_digest="0" * 60 + ANSI), "is not a sha256",
           "images_digest"),
    Attack("ansi-in-run-id", lambda lora: update(lora, run_id=ANSI * 50), "update of another run", None),
    Attack("ansi-in-mean-loss", lambda lora: update(lora, mean_loss=ANSI), "mean_loss", "mean_loss"),
    Attack("ansi-in-tensor-name", lambda lora: renamed(lora, f"lora.{ANSI}" + "z" * 5000), "unexpected", "unexpected"),
    Attack("ansi-in-non-lora-name", lambda lora: renamed(lora, f"evil{ANSI}"), "non-LoRA tensors", "non-LoRA tensors"),
    Attack("ansi-in-dtype", lambda lora: edited(lora, '"F32"', json.dumps(ANSI)), "not a safetensors file",
           "not a safetensors file"),
    Attack("unknown-metadata-key", lambda lora: update(lora, **{"x-note": "from a newer writer"}), "", "",
           accepted=True),
    # the FedAvg weight
    *(_num(value) for value in ("12.0", "1e3", "-5", "0", " 12", "12 ", "+12", "012", "1_000", "\u0661\u0662",
                                "9" * 40, "0x10")),
    # who and when
    Attack("another-run", lambda lora: update(lora, run_id="b" * 32), "update of another run", None),
    Attack("bundle-round-from-the-future", lambda lora: update(lora, bundle_round="3"), "newer than the run's last",
           None),
    # where its weights came from, on content (a run_id is only a name): another run's PromptFormer, none, a
    # forged digest, another class set
    Attack("foreign-promptformer", lambda lora: update(lora, promptformer_digest="f" * 64),
           "not over this run's round 2", None),
    Attack("no-promptformer", lambda lora: update(lora, promptformer_digest=None),
           "names no PromptFormer it was trained over", None),
    Attack("ansi-in-promptformer", lambda lora: update(lora, promptformer_digest=ANSI), "is not a sha256",
           "promptformer_digest"),
    Attack("another-class-set", lambda lora: update(lora, classes_digest="c" * 64), "trained on another class set",
           None),
    Attack("no-class-set", lambda lora: update(lora, classes_digest=None), "names no class set (classes_digest)", None),
    # the state it started from, on content (a round number is only a claim): none, another run's or round's
    Attack("no-base", lambda lora: update(lora, base_digest=None), "names no base state (base_digest", None),
    Attack("foreign-base", lambda lora: update(lora, base_digest="e" * 64),
           "is the state of none of this run's rounds 2-2", None),
    Attack("ansi-in-base", lambda lora: update(lora, base_digest=ANSI), "is not a sha256", "base_digest"),
    # finite is not enough: what a sender reports is bounded (an example-weighted mean of 1e308 is not finite)
    Attack("mean-loss-1e308", lambda lora: update(lora, mean_loss="1e308"), "mean_loss '1e308' is not within 0 to 1e+06",
           "mean_loss"),
    Attack("negative-loss", lambda lora: update(lora, mean_loss="-1.0"), "is not within 0 to", "mean_loss"),
    Attack("final-loss-1e300", lambda lora: update(lora, final_loss="1e300"), "final_loss", "final_loss"),
    Attack("lora-value-3e38", lambda lora: update({k: (v + (3e38 if i == 0 else 0)).astype(np.float32)
                                                   for i, (k, v) in enumerate(sorted(lora.items()))}),
           "a value of 3e+38, beyond the 10000 no trained weight reaches", "beyond the 10000"),
    Attack("train-seconds-infinite", lambda lora: update(lora, train_seconds="inf"), "train_seconds 'inf' is not within",
           "train_seconds"),
    Attack("created-in-the-future", lambda lora: update(lora, created="2999-01-01T00:00:00Z"), "", "", accepted=True),
]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The run: round 2 last, max_staleness 0, edge_max_examples 100, run_id RUN_ID."""
    from tests.run_fixtures import write_run

    root = tmp_path_factory.mktemp("update-attacks")
    write_run(root / "run", root / "preset.toml", "", "attacks")
    configure(root / "run", SERVER)
    PROMPTFORMERS.update({r: round_promptformer(root / "run", r) for r in (1, 2)})
    META["promptformer_digest"] = PROMPTFORMERS[2]  # what a good update of round 2 names
    META["base_digest"] = round_state(root / "run", 2)  # and the state it started from
    from fedmvp.attributes.sentences import SentenceStyle
    from fedmvp.run_classes import RunClass, class_set, write_classes

    classes = [RunClass("x", ("a photo",), SentenceStyle(prefix="", suffix=""))]
    write_classes(root / "run", classes)
    META["classes_digest"] = class_set(classes).digest
    return root


def one_line(text: str, fragment: str) -> None:
    """The user sees one printable line of bounded length: no newline, no escape, no megabytes."""
    assert fragment in text, text[:2000]
    assert "\n" not in text and "\x1b" not in text and text.isprintable(), repr(text[:2000])
    assert len(text) <= MAX_REASON, len(text)


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.id)
def test_ingest_refuses(root: Path, tmp_path: Path, attack: Attack) -> None:
    target = root / "run"
    if attack.accepted:  # this row writes round 3: on a copy
        target = tmp_path / "run"
        shutil.copytree(root / "run", target)
    path = tmp_path / "update.safetensors"
    path.write_bytes(attack.make(lora_of(target)))
    before = tree_digest(target)
    done = run("fedmvp", ["ingest", "--run", target, path], cwd=tmp_path)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 3, done.stdout[:3000]  # the table's head, this file's row, what was written
    assert lines[1].startswith(str(path))
    if attack.accepted:
        assert done.returncode == 0 and "accepted" in lines[1] and "round 3 written" in lines[2], done.stdout
        return
    assert done.returncode == 1 and "nothing written" in lines[2], done.stdout[:3000]
    outcome, reason = lines[1][len(str(path)):].strip().split("  ", 1)
    assert outcome == "rejected"
    one_line(reason, attack.reason)
    assert tree_digest(target) == before


@pytest.mark.parametrize("attack", [a for a in ATTACKS if a.edge is not None], ids=lambda a: a.id)
def test_the_device_reader_refuses(root: Path, tmp_path: Path, attack: Attack) -> None:
    from edge_client.update import UpdateError, read_update

    lora = lora_of(root / "run")
    bundle = bundle_for(tmp_path / "bundle", lora)
    path = tmp_path / "update.safetensors"
    path.write_bytes(attack.make(lora))
    if attack.accepted:
        assert read_update(path, bundle, check_bundle_id=False).num_examples == 10
        return
    with pytest.raises(UpdateError) as error:
        read_update(path, bundle, check_bundle_id=False)
    message = str(error.value)
    assert message.startswith(f"{path}: ")
    one_line(message[len(str(path)) + 2:], attack.edge)


def test_a_huge_file_is_refused_on_its_size_before_it_is_read(root: Path, tmp_path: Path) -> None:
    """256 MiB (sparse on disk): a file is never read whole when round R's LoRA cannot be that big."""
    from edge_client.update import UpdateError, read_update
    from fedmvp.federated.ingest import check_file
    from fedmvp.federated.replies import ReplyRules
    from fedmvp.presets.server import ServerSpec

    path = tmp_path / "huge.safetensors"
    with path.open("wb") as f:
        f.write(update(lora_of(root / "run")))
        f.truncate(256 << 20)
    rules = ReplyRules(run_id=RUN_ID, round=2, server=ServerSpec(max_staleness=0, edge_max_examples=100))
    tracemalloc.start()
    try:
        verdict = check_file(path, rules, lora_of(root / "run"), {})
        with pytest.raises(UpdateError) as error:
            read_update(path, bundle_for(tmp_path / "bundle", lora_of(root / "run")))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
    one_line(verdict.reason, f"{256 << 20} bytes, more than the")
    one_line(str(error.value)[len(str(path)) + 2:], f"{256 << 20} bytes, more than the")
    before = tree_digest(root / "run")
    assert run("fedmvp", ["ingest", "--run", root / "run", path], cwd=tmp_path).returncode == 1
    assert tree_digest(root / "run") == before


def test_a_file_that_is_not_a_regular_file_is_not_opened(root: Path, tmp_path: Path) -> None:
    """A FIFO named as an update would block the command on open() until someone writes to it."""
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    threading.Thread(target=_unblock, args=(fifo,), daemon=True).start()  # without the check: no hang, EOF
    before = tree_digest(root / "run")
    done = run("fedmvp", ["ingest", "--run", root / "run", fifo], cwd=tmp_path, timeout=30)
    assert done.returncode == 1 and "not a regular file" in done.stdout, done.stdout + done.stderr
    assert tree_digest(root / "run") == before


def _unblock(fifo: Path, seconds: float = 10.0) -> None:
    """Open ``fifo`` for writing once a reader has it open (a blocked reader then reads EOF)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            return
        except OSError:  # ENXIO: no reader yet
            time.sleep(0.05)


def test_a_hostile_file_name_is_shown_escaped_on_one_line(root: Path, tmp_path: Path) -> None:
    """A device chooses its update's name; the table shows it escaped, one row per file."""
    path = tmp_path / f"u{ANSI}.safetensors"
    path.write_bytes(update(lora_of(root / "run"), num_examples="0"))
    done = run("fedmvp", ["ingest", "--run", root / "run", path], cwd=tmp_path)
    lines = done.stdout.splitlines()
    assert done.returncode == 1 and len(lines) == 3, done.stdout
    assert "\x1b" not in done.stdout and all(line.isprintable() for line in lines)
    assert "\\x1b[31m\\nFAKE accepted" in lines[1] and "rejected" in lines[1]
