"""Files read whole or probed: ``sha256_file``, the writable probe, an OSError as one line; the cache root.

Why here: a bundle's manifest, a personalised LoRA and a run's files are hashed the same way, and
every command that will write for minutes probes its target first the same way. Standard library only.
"""

from __future__ import annotations

import errno
import hashlib
import os
import tempfile
from pathlib import Path


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
