"""Untrusted text as an error message may show it: escaped and cut short.

Why here: an update file, a Flower reply and a bundle are written by someone else; what they hold
reaches a terminal, a log or state.json only through these functions, in every package; a file name
a user's folder holds, through `path_shown`.
"""

from __future__ import annotations

import os
import re
from typing import Any

_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,120}")


def shown(value: Any, limit: int = 60) -> str:
    """``value`` as a one-line reason may show it: ``repr`` (newlines, ANSI escapes and every other
    unprintable character escaped), at most ``limit`` characters. What a sender wrote never reaches
    a terminal, a log or state.json raw, nor megabytes of it."""
    if isinstance(value, (str, bytes)):
        text = repr(value[:limit])
        return text if len(value) <= limit and len(text) <= limit + 3 else text[:limit] + "..."
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return "a huge integer"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    return f"a {type(value).__name__}"


def name_shown(name: str) -> str:
    """A tensor or record key as a reason shows it: as is when it looks like a name, else `shown`."""
    return name if _PLAIN_NAME.fullmatch(name) else shown(name)


def path_shown(path: str | os.PathLike) -> str:
    """A file path as a message shows it: as is when every character is printable, else with each
    unprintable character escaped (``\\n``, ``\\x1b``; a byte that is not UTF-8, ``\\xNN``). A newline or
    an ANSI escape in a file name never reaches a terminal raw; the path is not cut (the user needs all
    of it to find the file)."""
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if text.isprintable():
        return text
    try:  # undecodable bytes (os.fsdecode's surrogate escapes) as \xNN, as edge_client.images.printable
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        pass
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
