"""The line `fedmvp serve` prints per round without a terminal, from the round's state.json alone, and
the two fields of the round's record it needs (``timed_out``, ``seconds``). The real process's output is
asserted in tests/federated/test_open_deployment.py."""

from __future__ import annotations

import json

import pytest

from fedmvp_apps.deploy.server_lines import RoundWatch, round_line, round_record

SITE_A = {"node": 11, "role": "site", "site": 0, "name": "north-ward", "examples": 6, "loss": 0.9}
SITE_B = {"node": 12, "role": "site", "site": 1, "name": "south-ward", "examples": 6, "loss": 0.8}
EDGE = {"node": 40, "role": "edge", "examples": 3, "loss": 0.7, "bundle_id": "b"}
NAN = "the reply's tensor lora.a holds NaN or infinite values (2 of 3 entries), so it cannot be averaged"
EVALUATED = {"train_loss": 0.85, "local": 0.5, "base": 2 / 3, "new": None, "hm": None, "domain": None}

CASES = {
    "replies": ({"round": 2, "total_rounds": 3, "replies": [SITE_A, SITE_B, EDGE], "rejected": [], "timed_out": [],
                 "seconds": 3.14, "metrics": {"train_loss": 0.83}},
                "round 2/3: replied 3 (north-ward, south-ward, edge node 40), left out 0, timed out 0; loss 0.8300; "
                "3.1 s"),
    "rejections": ({"round": 1, "total_rounds": 3, "replies": [SITE_A], "timed_out": [], "seconds": 2.0,
                    "rejected": [{"node": 12, "site": 1, "name": "south-ward", "reason": NAN},
                                 {"node": 77, "site": None, "reason": "the client failed: boom"},
                                 {"node": 41, "site": None, "role": "edge", "reason": "too many examples"}],
                    "metrics": {"train_loss": 0.9}},
                   f"round 1/3: replied 1 (north-ward), left out 3 (south-ward: {NAN[:57]}..., node 77: the client "
                   f"failed: boom, edge node 41: too many examples), timed out 0; loss 0.9000; 2.0 s"),
    "timeouts": ({"round": 3, "total_rounds": 3, "replies": [SITE_A], "rejected": [],
                  "timed_out": ["south-ward", "site 2", "edge node 9", "edge node 10", "edge node 11"], "seconds": 120.04,
                  "metrics": {"train_loss": 1.0}},
                 "round 3/3: replied 1 (north-ward), left out 0, timed out 5 (south-ward, site 2, edge node 9, "
                 "edge node 10, +1 more); loss 1.0000; 120.0 s"),
    "evaluation": ({"round": 3, "total_rounds": 3, "replies": [SITE_A, SITE_B], "rejected": [], "timed_out": [],
                    "seconds": 4.0, "metrics": EVALUATED},
                   "round 3/3: replied 2 (north-ward, south-ward), left out 0, timed out 0; loss 0.8500; "
                   "Local 50.00, Base 66.67, New -, HM -; 4.0 s"),
    "trouble": ({"round": 1, "total_rounds": 3, "replies": [SITE_A], "timed_out": ["site 2"], "seconds": 2.0,
                 "rejected": [{"node": 12, "site": 1, "name": "south-ward", "reason": "the client failed: boom"}],
                 "metrics": {"train_loss": 0.9}},  # docs/tutorials/across-machines.md shows this one
                "round 1/3: replied 1 (north-ward), left out 1 (south-ward: the client failed: boom), timed out 1 "
                "(site 2); loss 0.9000; 2.0 s"),
    "late": ({"round": 2, "total_rounds": 3, "replies": [EDGE], "rejected": [], "timed_out": [], "seconds": 1.0,
              "late": ["edge node 41", "edge node 42"], "metrics": {"train_loss": 0.7}},  # over_selection
             "round 2/3: replied 1 (edge node 40), left out 0, timed out 0, late 2 (edge node 41, edge node 42); "
             "loss 0.7000; 1.0 s"),
    "none": ({"round": 4, "replies": [], "rejected": []},  # a round written before timed_out and seconds
             "round 4: replied 0, left out 0, timed out 0"),
    "ingest": ({"round": 5, "total_rounds": 3, "source": "ingest", "replies": [], "rejected": [],
                "ingest": [{"accepted": True}, {"accepted": False}], "metrics": {"train_loss": 0.5}},
               "round 5/3: ingested 1 of 2 update files; loss 0.5000"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_line_per_round_says_who_replied_was_left_out_or_timed_out_loss_figures_and_seconds(case):
    state, line = CASES[case]
    assert round_line(round_record(state)) == line
    assert "\n" not in line


def test_the_record_is_what_the_json_round_log_lists_and_reads_each_new_round_once(tmp_path):
    for number in (1, 2):
        folder = tmp_path / f"round-{number:04d}"
        folder.mkdir()
        state = {**CASES["evaluation"][0], "round": number, "complete": True, "replies": [SITE_A]}
        (folder / "state.json").write_text(json.dumps(state))
    (tmp_path / "round-0003").mkdir()  # being written: no state.json yet
    watch = RoundWatch(tmp_path, after=0)
    records = watch.new()
    assert [r["round"] for r in records] == [1, 2] and watch.new() == []
    assert records[0] == {"round": 1, "total_rounds": 3, "replied": ["north-ward"], "left_out": [], "timed_out": [],
                          "train_loss": 0.85, "seconds": 4.0, "evaluation": {k: EVALUATED[k] for k in
                                                                              ("local", "base", "new", "hm", "domain")}}
    assert RoundWatch(tmp_path).new() == []  # started on a resumed run: its earlier rounds are not told again


def test_a_name_a_site_gave_itself_reaches_the_line_escaped():
    state = {"round": 1, "replies": [{**SITE_A, "name": "evil\x1b[2Jname\nround 9: forged"}], "rejected": []}
    line = round_line(round_record(state))
    assert "\x1b" not in line and "\n" not in line


@pytest.mark.parametrize("as_json", [False, True])
def test_serve_without_a_terminal_prints_each_round_then_the_table_and_json_adds_them(tmp_path, small_world,
                                                                                     monkeypatch, as_json):
    """`fedmvp serve`'s own output around the run (the run itself faked: rounds appear as the ServerApp's
    would); the real processes' log: tests/federated/test_open_deployment.py."""
    import torch
    from click.testing import CliRunner

    import fedmvp.federated.evaluation as evaluation
    import fedmvp_apps.deploy.superlink as superlink
    from fedmvp.runs import RunDir
    from fedmvp_apps.cli import main
    from tests.federated.conftest import write_preset

    figures = {"run": "r", "round": 2, "zero-shot": {"local": 0.25, "hm": 0.5}, "tuned": {"local": 0.5, "hm": 0.75}}
    states = {n: {**CASES["evaluation"][0], "round": n, "total_rounds": 2, "replies": [SITE_A], "seconds": float(n)}
              for n in (1, 2)}

    def fake_serve(options, progress, on_event):
        run = RunDir(options.run_dir)
        run.write_config({"rounds": 2})
        for number, state in states.items():
            run.save_checkpoint(number, {"lora.a": torch.zeros(2)}, state)
            progress(number, "running")
        return "finished:completed"

    monkeypatch.setattr(superlink, "serve", fake_serve)
    monkeypatch.setattr(evaluation, "evaluate_run", lambda run, round_number=None: figures)
    run = tmp_path / "runs" / "r"
    args = ["serve", "--config", str(write_preset(tmp_path, small_world)), "--run-dir", str(run), "--insecure"]
    done = CliRunner().invoke(main, args + ["--json"] * as_json)
    assert done.exit_code == 0, done.output
    lines = [round_line(round_record(state)) for state in states.values()]
    if as_json:  # the lines on stderr; stdout the JSON alone
        assert all(line in done.stderr for line in lines) and json.loads(done.stdout)["final"] == figures
        assert [r["seconds"] for r in json.loads(done.stdout)["round_log"]] == [1.0, 2.0]
    else:
        table = evaluation.format_table(figures)
        assert done.stdout.index(lines[0]) < done.stdout.index(lines[1]) < done.stdout.index(f"\n{table}\n")
