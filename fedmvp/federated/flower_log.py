"""Flower's own warnings and errors, kept in the run directory (RUN/flower.log); left-out replies, said.

The simulation keeps the terminal to the progress bar and our own lines, so Flower's console at
INFO would drown them; but its warnings and errors (and those of Ray's driver, the simulation
engine) are what an operator needs when a run misbehaves. While ``flower_log`` is active every
record of Flower's logger (``flwr``, Flower's ``FLOWER_LOGGER``) and Ray's at WARNING and above is
appended to RUN/flower.log, opened without following a link (docs/security.md). A left-out reply
(``log_left_out``) is a marked record: `fedmvp train` echoes it as it happens, and `fedmvp serve`,
whose ServerApp is another process, reads the marked lines back from the file
(``FlowerLogTail``). docs/tutorials/across-machines.md and docs/security.md say how to read them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from flwr.supercore.logger import FLOWER_LOGGER, ConsoleHandler

from fedmvp_formats.nofollow import append_nofollow, open_nofollow

FLOWER_LOG = "flower.log"
MARK = "LEFT-OUT"  # the file's level column for a left-out reply: how `fedmvp serve` finds them
_MARKED = "fedmvp_left_out"  # the LogRecord attribute that marks one


def log_left_out(line: str) -> None:
    """A left-out reply as one WARNING of Flower's logger, marked so it is echoed (train) or tailed (serve)."""
    FLOWER_LOGGER.warning("%s", line, extra={_MARKED: True})


class _FileHandler(logging.StreamHandler):
    """Appends records to RUN/flower.log in its own format (ray.init re-formats the handlers of Ray's
    logger: this one keeps its own) and counts those an operator should look at: not Flower's
    deprecation notices, which concern fedmvp's code (run_simulation), not the run."""

    def __init__(self, stream: IO):
        super().__init__(stream)
        self.setLevel(logging.WARNING)
        self.noteworthy = 0

    def format(self, record: logging.LogRecord) -> str:
        level = MARK if getattr(record, _MARKED, False) else record.levelname
        text = f"{logging.Formatter().formatTime(record)} {level} {record.name}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        return text

    def emit(self, record: logging.LogRecord) -> None:
        if not record.getMessage().startswith("DEPRECATED FEATURE"):
            self.noteworthy += 1
        super().emit(record)


class _Echo(logging.Handler):
    """Hands each marked record's message to ``echo`` (the terminal of `fedmvp train`)."""

    def __init__(self, echo: Callable[[str], None]):
        super().__init__(logging.WARNING)
        self.echo = echo
        self.addFilter(lambda record: bool(getattr(record, _MARKED, False)))

    def emit(self, record: logging.LogRecord) -> None:
        self.echo(record.getMessage())


@contextlib.contextmanager
def flower_log(run_dir: str | Path, echo: Callable[[str], None] | None = None,
               quiet_console: bool = False) -> Iterator[FlowerLog]:
    """While inside: Flower's and Ray's driver's WARNING and above appended to RUN/flower.log;
    ``echo`` hears each left-out reply; ``quiet_console``: Flower's console shows only errors and
    nothing of Flower's reaches the root logger (the simulation's terminal; a deployed ServerApp's
    console is its `flwr log`, left as it is)."""
    path = Path(run_dir) / FLOWER_LOG
    stream = append_nofollow(path)
    handlers = _FileHandler(stream), _FileHandler(stream)
    ray = logging.getLogger("ray")
    added = [(FLOWER_LOGGER, handlers[0]), (ray, handlers[1])] + ([(FLOWER_LOGGER, _Echo(echo))] if echo else [])
    consoles = [h for h in FLOWER_LOGGER.handlers if isinstance(h, ConsoleHandler)] + list(ray.handlers) \
        if quiet_console else []
    saved = [(h, h.level) for h in consoles], FLOWER_LOGGER.level, FLOWER_LOGGER.propagate, ray.level
    for handler in consoles:
        handler.setLevel(max(handler.level, logging.ERROR))
    if quiet_console:  # ray.init sets its logger's level too (the simulation's logging_level: WARNING)
        FLOWER_LOGGER.setLevel(logging.WARNING)
        ray.setLevel(logging.WARNING)
        FLOWER_LOGGER.propagate = False
    for logger, handler in added:
        logger.addHandler(handler)
    try:
        yield FlowerLog(path, handlers)
    finally:
        for logger, handler in added:
            logger.removeHandler(handler)
        for handler, level in saved[0]:
            handler.setLevel(level)
        FLOWER_LOGGER.setLevel(saved[1])
        FLOWER_LOGGER.propagate = saved[2]
        ray.setLevel(saved[3])
        stream.close()


class FlowerLog:
    """RUN/flower.log while it is written: ``note`` is the closing line naming it, when the run logged
    something worth a look (None: nothing, or only Flower's deprecation notices)."""

    def __init__(self, path: Path, handlers: tuple[_FileHandler, ...]):
        self.path, self.handlers = path, handlers

    @property
    def note(self) -> str | None:
        return log_note(self.path.parent, 0) if sum(h.noteworthy for h in self.handlers) else None


def log_size(run_dir: str | Path) -> int:
    """RUN/flower.log's size now (0: none yet): what a run added is what it grew by."""
    try:
        return os.lstat(Path(run_dir) / FLOWER_LOG).st_size
    except OSError:
        return 0


def log_note(run_dir: str | Path, since: int) -> str | None:
    """The closing line naming RUN/flower.log when it grew past ``since`` bytes (None: it did not)."""
    path = Path(run_dir) / FLOWER_LOG
    return f"Flower's warnings and errors of this run: {path}" if log_size(run_dir) > since else None


class FlowerLogTail:
    """The left-out replies a deployed ServerApp appends to RUN/flower.log, read as they come
    (`fedmvp serve`); a line still being written is kept for the next read."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / FLOWER_LOG
        self.offset = log_size(run_dir)  # an earlier start's lines were shown then
        self.start = self.offset
        self.partial = b""

    def left_out(self) -> list[str]:
        try:
            with os.fdopen(open_nofollow(self.path, os.O_RDONLY), "rb") as f:
                f.seek(self.offset)
                data = f.read()
                self.offset = f.tell()
        except OSError:
            return []
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        marker = f" {MARK} "
        shown = (line.decode("utf-8", errors="replace") for line in lines)
        return [line.split(marker, 1)[1].split(": ", 1)[-1] for line in shown if marker in line]

    def note(self) -> str | None:
        """The closing line naming RUN/flower.log when this start's ServerApp added to it."""
        return log_note(self.path.parent, self.start)
