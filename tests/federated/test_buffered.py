"""Buffered asynchronous versions (FedBuff, issue 26 §2) with real processes on 127.0.0.1, TLS on:
`fedmvp serve --mode buffered` (over a preset's
[server] concurrency and buffer_size) and three `edge-client join` devices, no site.

- Device C is paused (SIGSTOP: a slow or sleeping device) after the first buffered version; the
  other two keep writing versions meanwhile: the fast ones never wait for the slow one.
- Resumed, C's reply is based on an old version: it is taken, weighted by n * s(t), t >= 1.
- Device B is killed (SIGKILL) while it trains: the run completes without it.
- Every version's global LoRA is theta_{v-1} + sum_i n_i s(t_i) (u_i - theta_{base_i}) / sum_i n_i,
  recomputed here from the devices' own update files (`--out`) and the recorded checkpoints.
"""

from __future__ import annotations

import os
import signal
import subprocess

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from fedmvp_formats.promptformer import state_base_digest
from tests.federated.processes import ENV, FEDMVP, Processes
from tests.federated.test_edge_join import local_folder, prepare_run, states, update_files

pytestmark = pytest.mark.deployment  # starts a federation (see pyproject.toml markers)

FIRST, LAST = 3, 10  # rounds 1-2 are prepared; versions 3..10 are buffered
EXAMPLES = {"a": 9, "b": 6, "c": 12}  # training images per device (3 of every 4 kept): who replied


BUFFERED = """
[server]
concurrency = 3
buffer_size = 2
max_staleness = 20
round_timeout = 45
"""


@pytest.mark.slow  # eight buffered versions of three devices, one paused and one killed mid-run
@pytest.mark.timeout(900)
def test_buffered_versions_fast_devices_never_wait_stale_replies_are_discounted(tmp_path, small_world):
    from edge_client.bundle import Bundle
    from export.bundle_writer import export_bundle
    from fedmvp_apps.deploy.supernode import free_port

    preset, run = prepare_run(tmp_path, small_world, LAST, BUFFERED)  # resumed at version 3
    bundles = {name: tmp_path / f"device-{name}" / "bundle" for name in "abc"}
    for bundle in bundles.values():
        export_bundle(run, 2, bundle)
    classes = Bundle.open(bundles["a"]).class_names
    data = {"a": local_folder(small_world, classes[:3], 4, tmp_path / "device-a" / "local"),
            "b": local_folder(small_world, classes[2:4], 4, tmp_path / "device-b" / "local"),
            "c": local_folder(small_world, classes[:4], 4, tmp_path / "device-c" / "local")}
    certs = tmp_path / "certs"
    subprocess.run([*FEDMVP, "certs", "--out", str(certs)], check=True, capture_output=True, env=ENV)
    port = free_port()
    procs = Processes(tmp_path)
    paused: list[int] = []
    try:
        procs.start_buffered(preset, run, certs, port, {name: (bundles[name], data[name]) for name in "abc"})
        procs.wait_for("version 3", lambda: FIRST in states(run), 300)
        os.killpg(procs.procs["edge-c"].pid, signal.SIGSTOP)  # C sleeps, mid-update or idle
        paused.append(procs.procs["edge-c"].pid)
        stopped_at = max(states(run))
        procs.wait_for("two versions without C", lambda: max(states(run)) >= stopped_at + 2, 120)
        slept = set(range(stopped_at + 1, max(states(run)) + 1))
        os.killpg(procs.procs["edge-c"].pid, signal.SIGCONT)
        paused.clear()
        woke = max(slept)
        procs.wait_for("C's stale reply", lambda: any(
            r["examples"] == EXAMPLES["c"] and r["base"] < woke
            for v, s in states(run).items() if v > woke for r in s["replies"]), 120)
        killed_after = max(states(run))
        procs.kill("edge-b")  # mid-update or between two: nothing of it may count from here on
        assert procs.exit_code("serve", 420, run) == 0, procs.log("serve")[-3000:]
    finally:
        for pid in paused:
            os.killpg(pid, signal.SIGCONT)
        procs.stop()
    versions = {v: s for v, s in states(run).items() if v >= FIRST}
    assert sorted(versions) == list(range(FIRST, LAST + 1))
    by_examples = {n: name for name, n in EXAMPLES.items()}
    for number, state in versions.items():
        assert len(state["replies"]) == 2 and state["sites"] == []
        devices = state["devices"]  # what happened to the devices since the version before (dropouts.py)
        assert (devices["taken"], devices["wanted"], devices["closed"]) == (2, 2, "buffer_size")
        assert devices["late"] == 0
        total = sum(r["examples"] for r in state["replies"])
        for reply in state["replies"]:
            assert reply["staleness"] == number - 1 - reply["base"] >= 0
            assert reply["s"] == pytest.approx((1 + reply["staleness"]) ** -0.5)
            assert reply["weight"] == pytest.approx(reply["examples"] * reply["s"] / total)
    # Every update taken was sent and replied to, counted once in a version's ``devices``.
    assert sum(s["devices"]["selected"] for s in versions.values()) >= 2 * len(versions)
    assert sum(s["devices"]["replied"] for s in versions.values()) >= 2 * len(versions)
    # The fast devices never waited for C: versions were written while it slept, from A and B (and at
    # most the one reply C had sent before it fell asleep).
    assert len(slept) >= 2
    assert sum(by_examples[r["examples"]] == "c" for v in slept for r in versions[v]["replies"]) <= 1
    # C's reply after it woke is based on a version from before: weighted by its staleness.
    stale = [r for v in versions if v > woke for r in versions[v]["replies"]
             if by_examples[r["examples"]] == "c" and r["base"] < woke]
    assert stale and all(r["staleness"] >= 1 and r["s"] < 1 for r in stale)
    # Nothing of B once it was killed (but a reply it had sent before).
    assert LAST > killed_after + 1
    assert sum(by_examples[r["examples"]] == "b" for v in versions if v > killed_after
               for r in versions[v]["replies"]) <= 1
    # The weights themselves: each version from the previous one and the devices' update files.
    # Every record parses with a strict parser: a version's train_ce, measured by no device, is null, not NaN.
    from fedmvp_formats.strict_json import loads

    for record in [*run.glob("round-*/state.json"), run / "config.json"]:
        loads(record.read_text())
    assert all(loads(line)["train_ce"] is None for line in (run / "metrics.jsonl").read_text().splitlines())
    files = {name: update_files(tmp_path / f"device-{name}" / "updates") for name in "abc"}
    used = {name: 0 for name in "abc"}
    lora = {v: {k: t for k, t in load_file(str(run / f"round-{v:04d}" / "global.safetensors")).items()
                if k.startswith("lora.")} for v in range(2, LAST + 1)}
    for number in range(FIRST, LAST + 1):
        replies = sorted(versions[number]["replies"], key=lambda r: (r["base"], r["bundle_id"], r["node"]))
        step = {k: np.zeros(t.shape, np.float64) for k, t in lora[number - 1].items()}
        for reply in replies:
            name = by_examples[reply["examples"]]
            path = files[name][used[name]]
            update = load_file(str(path))
            used[name] += 1
            # the kept file names the version it was trained from, by number and by state (fedmvp ingest takes it)
            with safe_open(str(path), "np") as handle:
                meta = handle.metadata()
            assert int(meta["bundle_round"]) == reply["base"] and f"update-r{reply['base']:04d}-" in path.name
            assert meta["base_digest"] == state_base_digest(load_file(str(run / f"round-{reply['base']:04d}" /
                                                                          "global.safetensors")))
            for key in step:
                step[key] += reply["weight"] * (update[key].astype(np.float64) - lora[reply["base"]][key])
        for key, value in step.items():
            expected = (lora[number - 1][key].astype(np.float64) + value).astype(np.float32)
            np.testing.assert_allclose(lora[number][key], expected, rtol=1e-5, atol=1e-7, err_msg=f"version {number}")
