"""What an operator reads when replies are left out: a line per reply as it happens, a failed round
naming each site and reason, and Flower's own warnings kept in RUN/flower.log (docs/troubleshooting.md)."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest

from tests.deadlines import scaled
from tests.site_trees import site_preset, world_classes

FEDMVP = [sys.executable, "-m", "fedmvp_apps.cli"]


@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
@pytest.mark.timeout(300)
def test_train_says_each_left_out_reply_and_the_failed_round_names_them(tmp_path, small_world):
    """Two honest sites whose every update exceeds [server] max_update_norm (a bound far too tight):
    `fedmvp train` says each left-out reply (site id and name, node, round, reason) as it happens, the
    failure lists them, and RUN/flower.log holds Flower's own warnings and the same lines."""
    seen, held = world_classes(small_world)
    preset = site_preset(tmp_path, small_world, {"site-a": seen[:2] + held[:1], "site-b": seen[2:4]}, held[:1],
                         rounds=1)
    preset.write_text(preset.read_text() + "\n[server]\nmax_update_norm = 1e-9\nround_retries = 1\n")
    run_dir = tmp_path / "run"
    done = subprocess.run([*FEDMVP, "train", "--config", str(preset), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=scaled(280))
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    said = []
    for site, name in ((0, "site-a"), (1, "site-b")):
        found = re.findall(rf"^round 1: left out the reply of (site {site} '{name}' \(node \d+\): "
                           rf"update norm [0-9.e+-]+ exceeds the bound 1e-09)$", out, re.M)
        assert len(found) == 1, out[-3000:]
        said += found
    error = out[out.index("Error: "):].splitlines()
    assert error[0] == "Error: round 1: fewer than 2 usable replies in 1 tries; left out:", out[-3000:]
    assert sorted(error[1:3]) == [f"  {line}" for line in said]  # each sender and reason, as said
    log = (run_dir / "flower.log").read_text()
    assert re.search(r"WARNING flwr: DEPRECATED FEATURE: The `run_simulation` function", log)  # Flower's own
    left = [line.split(" LEFT-OUT flwr: ")[1] for line in log.splitlines() if " LEFT-OUT flwr: " in line]
    assert sorted(left) == sorted(line for line in out.splitlines() if line.startswith("round 1: left out"))
    assert f"Flower's warnings and errors of this run: {run_dir / 'flower.log'}" in out


def test_flower_warnings_reach_the_file_not_the_terminal(tmp_path):
    """Inside ``flower_log`` (the simulation's): a Flower warning is in RUN/flower.log only, a left-out
    reply is also said once, an error still reaches Flower's console; after it, Flower's logger is as it was."""
    import io

    from flwr.supercore.logger import FLOWER_LOGGER, ConsoleHandler

    from fedmvp.federated.flower_log import flower_log, log_left_out

    before = FLOWER_LOGGER.level, FLOWER_LOGGER.propagate, [h.level for h in FLOWER_LOGGER.handlers]
    console = io.StringIO()  # Flower's console, whatever stream it was bound to at import
    streams = [(h, h.setStream(console)) for h in FLOWER_LOGGER.handlers if isinstance(h, ConsoleHandler)]
    said: list[str] = []
    try:
        with flower_log(tmp_path, echo=said.append, quiet_console=True) as kept:
            FLOWER_LOGGER.warning("a warning of Flower's")
            log_left_out("round 2: left out the reply of site 1 (node 7): NaN")
            FLOWER_LOGGER.error("an error of Flower's")
            logging.getLogger("ray").warning("a warning of Ray's driver")
    finally:
        for handler, stream in streams:
            handler.setStream(stream)
    terminal = console.getvalue()
    assert "a warning of Flower's" not in terminal and "left out" not in terminal
    assert "an error of Flower's" in terminal
    assert said == ["round 2: left out the reply of site 1 (node 7): NaN"]
    text = (tmp_path / "flower.log").read_text()
    assert all(s in text for s in ("WARNING flwr: a warning of Flower's", "ERROR flwr: an error of Flower's",
                                   "LEFT-OUT flwr: round 2: left out", "WARNING ray: a warning of Ray's driver"))
    assert kept.note == f"Flower's warnings and errors of this run: {tmp_path / 'flower.log'}"
    assert (FLOWER_LOGGER.level, FLOWER_LOGGER.propagate, [h.level for h in FLOWER_LOGGER.handlers]) == before


def test_serve_reads_the_serverapps_left_out_replies_as_they_come(tmp_path):
    """`fedmvp serve`'s view of RUN/flower.log: only the left-out lines this start added, a line cut
    mid-write kept for the next read; a planted link instead of the log is neither written nor read."""
    from fedmvp.federated.flower_log import FlowerLogTail

    log = tmp_path / "flower.log"
    log.write_text("2026-01-01 00:00:00,000 LEFT-OUT flwr: round 1: an earlier start's line\n")
    tail = FlowerLogTail(tmp_path)
    with open(log, "a") as f:
        f.write("2026-01-01 00:00:01,000 WARNING flwr: not a left-out reply\n"
                "2026-01-01 00:00:02,000 LEFT-OUT flwr: round 2: left out the reply of site 0 'a' (node 5): "
                "num-examples 9 exceeds the site's 8 training images\n2026-01-01 00:00:03,000 LEFT-OUT fl")
    assert tail.left_out() == ["round 2: left out the reply of site 0 'a' (node 5): num-examples 9 exceeds the "
                               "site's 8 training images"]
    with open(log, "a") as f:
        f.write("wr: round 2: left out the reply of node 6: malformed reply\n")
    assert tail.left_out() == ["round 2: left out the reply of node 6: malformed reply"]
    assert tail.note() == f"Flower's warnings and errors of this run: {log}"

    from fedmvp.federated.flower_log import flower_log

    target = tmp_path / "elsewhere.txt"
    target.write_text("kept\n")
    planted = tmp_path / "planted"
    planted.mkdir()
    os.symlink(target, planted / "flower.log")
    with pytest.raises(OSError):
        with flower_log(planted):
            pass
    assert target.read_text() == "kept\n"
    assert FlowerLogTail(planted).left_out() == []


def test_a_nodes_own_error_text_cannot_forge_a_line_of_the_output():
    """A failed node's error reason (Flower's, the node's text) is shown escaped: one line, in the record
    and the printed line alike."""
    from fedmvp.federated.replies import left_out_line, left_out_record, round_failed

    entry = left_out_record(5, None, "the client failed: boom\nround 9: left out the reply of site 0: \x1b[2J", None,
                            {0: "north"})
    line = left_out_line(1, entry)
    assert "\n" not in line and "\x1b" not in line and line.startswith("round 1: left out the reply of node 5: '")
    assert entry["reason"] in line
    named = left_out_record(7, 0, "NaN", "site", {0: "north\x1b[1m"})
    assert left_out_line(2, named) == "round 2: left out the reply of site 0 'north\\x1b[1m' (node 7): NaN"
    assert round_failed(2, 2, 3, [named, named]).splitlines() == [
        "round 2: fewer than 2 usable replies in 3 tries; left out:", "  site 0 'north\\x1b[1m' (node 7): NaN"]
