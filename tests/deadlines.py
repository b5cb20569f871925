"""One factor for every real-process wait in the tests (docs/testing.md, A loaded machine).

``FEDMVP_TEST_TIME_FACTOR`` (default 1) multiplies every deadline a test gives a real process: a
subprocess timeout, a wait for a log line or a state file, pytest-timeout's limit. A busy machine is given
more time by setting it (e.g. 2), never by editing tests. Deadlines only bound a wait: a test that passes
never waits them out, so a larger factor costs nothing when all is well.
"""

from __future__ import annotations

import os

ENV_NAME = "FEDMVP_TEST_TIME_FACTOR"


def time_factor() -> float:
    """The factor from the environment; a value that is not a positive number is refused in one line."""
    text = os.environ.get(ENV_NAME, "1").strip() or "1"
    try:
        factor = float(text)
    except ValueError:
        raise SystemExit(f"{ENV_NAME}={text!r}: not a number (1 is the default; 2 gives every wait twice as long)")
    if not factor > 0 or factor != factor or factor == float("inf"):
        raise SystemExit(f"{ENV_NAME}={text!r}: must be a positive finite number")
    return factor


FACTOR = time_factor()


def scaled(seconds: float) -> float:
    """``seconds`` times the factor: the deadline of one real-process wait."""
    return seconds * FACTOR
