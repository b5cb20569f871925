"""Run directories: the accuracy plot of a run that has no New classes or no held-out domain."""

from __future__ import annotations

from fedmvp.runs import RunDir


def test_plot_leaves_out_metrics_a_protocol_does_not_have(tmp_path):
    run = RunDir(tmp_path)
    run.write_json("zero_shot.json", {"local": 0.5, "base": 0.4, "new": None, "hm": 0.45, "domain": None})
    for number in (1, 2):
        run.append_metrics({"round": number, "local": 0.6, "base": 0.5, "new": None, "hm": 0.55, "domain": None})
    assert run.plot().read_bytes()[:4] == b"\x89PNG"
