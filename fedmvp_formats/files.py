"""Files read whole or probed: ``sha256_file``, the writable probe, an OSError as one line; the cache root;
a JSON record read whole (`read_json_object`, one error rule); a run directory's file names and marker.

Why here: a bundle's manifest, a personalised LoRA and a run's files are hashed the same way, and
every command that will write for minutes probes its target first the same way. A run's file names
are spelled here once (``fedmvp.runs.RunDir`` is their one user in fedmvp) because the device must
recognise a run directory too (to refuse writing into one), and it imports nothing of fedmvp.
Standard library only.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from fedmvp_formats.nofollow import CLOEXEC, NOFOLLOW, NONBLOCK, path_shown

# ---- a run directory's names (``fedmvp.runs.RunDir`` owns the run and documents its layout) ----------
RUN_CONFIG = "config.json"  # the run's record
RUN_FORMAT_KEY = "format"  # config.json's marker
RUN_FORMAT_NAME = "fedmvp-run"
RUN_FORMAT = f"{RUN_FORMAT_NAME}/1"  # written by every run made since the marker existed
RUN_PRESET_COPY = "preset.toml"  # the preset's recorded text, written with config.json when a run is made
RUN_CLASSES = "classes.json"  # the federation's class set, written when a run is made with its data
RUN_METRICS = "metrics.jsonl"  # one row per round
ROUND_PREFIX = "round-"  # round-NNNN/: one checkpoint per round
ROUND_STATE = "state.json"  # round-NNNN/state.json: the round's record, written with its weights
ROUND_WEIGHTS = "global.safetensors"  # round-NNNN/global.safetensors: the round's global tensors
# A run made before the marker: its config.json with one of these beside it, or a round-NNNN/state.json
# (every fedmvp wrote at least one of them with, or soon after, config.json).
RUN_FILES_BEFORE_FORMAT = (RUN_PRESET_COPY, RUN_CLASSES, RUN_METRICS)

# What `read_json_object` finds wrong with a record (``JsonRecordError.problem``), one wording each.
MISSING = "missing"
LINK = "a symbolic link (a record is read from where it lies, never through a link)"
NOT_A_FILE = "not a regular file"
UNREADABLE = "unreadable"
CUT_SHORT = "cut short or not JSON"
NOT_AN_OBJECT = "not a JSON object"


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks (bundle files can be hundreds of MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def cache_root() -> Path:
    """Where fedmvp keeps what it can recompute: ``$FEDMVP_CACHE``, else ``~/.cache/fedmvp`` (the synthetic
    world, text features, the device's runtime verdicts)."""
    return Path(os.environ.get("FEDMVP_CACHE") or Path.home() / ".cache" / "fedmvp")


def nearest_existing(path: str | os.PathLike) -> Path:
    """``path`` (made absolute) or its nearest ancestor that exists: where a folder not made yet would go."""
    existing = Path(os.path.abspath(path))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return existing


def probe_writable(folder: str | os.PathLike, create: bool = True) -> Path:
    """Write, fsync and remove a probe file in ``folder`` (made first with ``create``, else in its nearest
    existing ancestor): a read-only or full disk stops the work before it starts, not after an hour of
    rounds. Raises OSError naming the path (``NotADirectoryError`` when a file is in the way); returns
    the folder probed."""
    existing = nearest_existing(folder)
    if not existing.is_dir():  # mkdir would only say "File exists"
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory (a file is in the way)", str(existing))
    target = Path(folder) if create else existing
    target.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=f".probe.{os.getpid()}.", dir=target)
    try:
        os.write(fd, b"0" * 4096)
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(probe)
    return target


def os_error_line(err: OSError) -> str:
    """An OSError (EACCES, EROFS, ENOSPC, ...) as one line that names the path first."""
    where = err.filename if err.filename is not None else "error"
    return f"{where}: {err.strerror or err}"


def is_run_format(value: object) -> bool:
    """Whether a config.json ``format`` value marks a fedmvp run (any version: a newer run is still a run)."""
    return isinstance(value, str) and value.split("/", 1)[0] == RUN_FORMAT_NAME


class JsonRecordError(ValueError):
    """A JSON record `read_json_object` cannot return: ``problem`` is one of the wordings above, ``errno``
    the OSError's where there was one; ``str()`` is ``FILE: problem (detail)``."""

    def __init__(self, path: str | os.PathLike, problem: str, detail: str = "", error: int | None = None) -> None:
        super().__init__(f"{path_shown(path)}: {problem}{f' ({detail})' if detail else ''}")
        self.path, self.problem, self.errno = Path(path), problem, error


def read_json_object(path: str | os.PathLike, follow_links: bool = False) -> dict[str, Any]:
    """The JSON object in ``path``, read whole; anything else is one `JsonRecordError` naming the file and
    the problem. Never through a link unless ``follow_links``: a run or a bundle is copied between machines
    and users, and a name planted as a link would make it report another file as its record. A FIFO or a
    device is never waited on or read."""
    try:
        fd = os.open(path, os.O_RDONLY | CLOEXEC | NONBLOCK | (0 if follow_links else NOFOLLOW))
    except FileNotFoundError:
        raise JsonRecordError(path, MISSING) from None
    except OSError as err:
        if not follow_links and (err.errno == errno.ELOOP or os.path.islink(path)):
            raise JsonRecordError(path, LINK) from None
        raise JsonRecordError(path, UNREADABLE, err.strerror or str(err), err.errno) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise JsonRecordError(path, NOT_A_FILE)
        if NONBLOCK:
            os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = handle.read()
    except OSError as err:
        raise JsonRecordError(path, UNREADABLE, err.strerror or str(err), err.errno) from None
    finally:
        os.close(fd)
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise JsonRecordError(path, CUT_SHORT, str(err)) from None
    if not isinstance(record, dict):
        raise JsonRecordError(path, NOT_AN_OBJECT, f"got {type(record).__name__}")
    return record
