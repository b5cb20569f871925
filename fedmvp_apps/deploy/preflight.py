"""How a join and its warm executor speak about the executor's preflight: the checks it runs first, with the
libraries its first message loads anyway, before the join starts the SuperNode (`fedmvp join` of a
``[federation]`` site: `fedmvp_apps.cli.join_preflight`). One line on the executor's stdout answers: passed,
or refused with the reason. Its own module so the join reads the answer without importing the executor
(which imports Flower), and no third party at all."""

from __future__ import annotations

PASSED = "fedmvp-preflight: passed"
REFUSED = "fedmvp-preflight: refused: "  # + the reason, one line
EXIT_REFUSED = 2  # the executor's exit after a refusal: the join's bad input, nothing connected
