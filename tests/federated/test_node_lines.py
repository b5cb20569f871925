"""The rules of a site's and a device's own lines (fedmvp_apps/deploy/node_lines.py) and of leaving
when the run ends (supernode_process.RunWatch); the real commands: tests/federated/test_serve_join.py."""

from __future__ import annotations

import pytest

from fedmvp_apps.deploy.node_lines import BAD_KEY, NO_KEY, NodeLines
from fedmvp_apps.deploy.supernode_process import RunWatch

GREEN, YELLOW, RED, RESET = "\x1b[92m", "\x1b[93m", "\x1b[91m", "\x1b[0m"


def lines(*fed: tuple[str, str]) -> tuple[list[str], NodeLines]:
    out: list[str] = []
    node = NodeLines("10.0.0.5:9092", out.append)
    for source, line in fed:
        node.feed(source, line + "\n")
    node.flush("supernode")
    return out, node


@pytest.mark.parametrize("fed,shown", [
    ([("executor", f"{YELLOW}WARNING {RESET}:   Connection attempt failed, retrying in 0.20 seconds"),
      ("executor", f"{GREEN}INFO {RESET}:      Connection successful after 3.97 seconds and 4 tries."),
      ("supernode", f"{YELLOW}WARNING {RESET}:   Connection attempt failed, retrying in 1.00 seconds"),
      ("supernode", "INFO:     Uvicorn running on http://127.0.0.1:46953 (Press CTRL+C to quit)")], []),
    ([("supernode", f"{GREEN}INFO {RESET}:      SuperNode ID: 42"),
      ("supernode", f"{YELLOW}WARNING {RESET}:   Connection attempt failed, retrying in 1.00 seconds"),
      ("supernode", f"{YELLOW}WARNING {RESET}:   Connection attempt failed, retrying in 2.00 seconds"),
      ("supernode", f"{GREEN}INFO {RESET}:      Connection successful after 3.00 seconds and 3 tries.")],
     ["connected to 10.0.0.5:9092",
      "lost the SuperLink at 10.0.0.5:9092; trying again until it answers (Ctrl-C stops)",
      "connected to 10.0.0.5:9092 again"]),
    ([("executor", "[fedmvp] round 3: trained on 40 images (loss 0.5000, 1.2 s)"),
      ("executor", f"{GREEN}INFO {RESET}:      [RUN 7, ROUND 3]"),
      ("executor", f"{YELLOW}WARNING {RESET}:   something a site must see"),
      ("executor", "  its second line"),
      ("executor", "WARNING:root:No pretrained weights loaded"),
      ("executor", f"{GREEN}INFO {RESET}:      edge: round 3, training the global LoRA on 40 local images"),
      ("executor", f"{GREEN}INFO {RESET}:      edge: bundle b refreshed to the PromptFormer of round 3")],
     ["round 3: trained on 40 images (loss 0.5000, 1.2 s)", "flower: WARNING: something a site must see",
      "  its second line", "WARNING:root:No pretrained weights loaded",
      "edge: bundle b refreshed to the PromptFormer of round 3"]),
    ([("supernode", f"{RED}ERROR {RESET}:     Exit Code: 305"), ("supernode", "Failed to initialize the connection"),
      ("supernode", "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed")],
     ["flower: ERROR: Exit Code: 305", "Failed to initialize the connection",
      "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"]),
])
def test_flower_info_is_dropped_warnings_and_errors_kept_and_connections_said_when_true(fed, shown):
    assert lines(*fed)[0] == shown


@pytest.mark.parametrize("public,refusal", [("[code: 2003] SuperNode authentication is enabled. All SuperNodes must "
                                             "be registered via the CLI.", NO_KEY),
                                            ("[code: 2004] Failed to activate SuperNode.", BAD_KEY)])
def test_a_key_refusal_block_is_held_back_for_the_one_line(public, refusal):
    out, node = lines(("supernode", f"{RED}ERROR {RESET}:     Exit Code: 305"),
                      ("supernode", "Failed to initialize the connection to the SuperLink."), ("supernode", public))
    assert out == [] and node.key_refused == refusal


class Ended(Exception):
    """Flower's RunNotRunningException, standing in."""


def test_the_node_leaves_when_its_run_stays_ended_but_not_after_losing_its_superlink(capsys):
    answers = []

    def get_run(run_id: int):
        if answers.pop(0) == "ended":
            raise Ended

    now = [0.0]
    watch = RunWatch(every=0.5, confirm=1.5, clock=lambda: now[0])
    watch.idle(get_run, Ended)  # no run yet: nothing to ask
    watch.seen(7)
    watch.lost = True  # a restarted SuperLink would report the old run finished: not asked, the node stays
    watch.idle(get_run, Ended)
    watch.seen(8)  # the restarted server's run
    for at, answer in ((1, "ended"), (2, "running"), (3, "ended"), (4, "ended")):  # said again 1 s later: not yet
        now[0] = at
        answers.append(answer)
        watch.idle(get_run, Ended)
    now[0] = 4.5
    answers.append("ended")
    with pytest.raises(SystemExit) as ended:
        watch.idle(get_run, Ended)  # still ended 1.5 s after it was first: the run is over
    assert ended.value.code == 0 and capsys.readouterr().out == "[fedmvp] run 8 ended on the server; leaving\n"


@pytest.mark.parametrize("phase", [0.0, 0.5, 1.0, 1.5, 1.9])
def test_an_idle_node_hears_its_run_end_before_serve_stops_its_superlink(phase):
    """`fedmvp serve` keeps its SuperLink up RUN_END_NOTICE s after the run ended; a node pulling every
    IDLE_PULL_SECONDS, at any phase to that end, must have left by then, with a second of its requests to
    spare (a node that missed it polls a gone SuperLink for ever: the sites never leave)."""
    from fedmvp_apps.deploy.superlink import RUN_END_NOTICE
    from fedmvp_apps.deploy.supernode_process import IDLE_PULL_SECONDS, RUN_CHECK_SECONDS, RUN_END_CONFIRM

    now = [0.0]

    def get_run(run_id: int):
        assert now[0] < RUN_END_NOTICE - 1.0, f"asked at {now[0]} s: the SuperLink is gone"
        raise Ended  # the run ended at 0

    watch = RunWatch(every=RUN_CHECK_SECONDS, confirm=RUN_END_CONFIRM, clock=lambda: now[0])
    watch.seen(9)
    now[0] = phase
    with pytest.raises(SystemExit):
        for _ in range(10):
            watch.idle(get_run, Ended)
            now[0] += IDLE_PULL_SECONDS
