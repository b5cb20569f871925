"""Benchmark sections run for real (comm whole, train --quick in process): their records hold what
was asked for. Figures are not checked (the machine is shared); structure and settings are."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import comm, train
from benchmarks.common import Options, Section


def _is_flat(row: dict) -> bool:
    return all(isinstance(v, (str, int, float, bool, type(None))) for v in row.values())


@pytest.fixture(scope="module")
def comm_section() -> Section:
    return comm.run(Options(quick=True))


@pytest.fixture(scope="module")
def train_section() -> Section:
    return train.run(Options(quick=True, threads=2), fresh_processes=False)


def test_comm_rows_cover_every_model_message_and_dtype(comm_section: Section) -> None:
    keys = {(r["model"], r["message"], r["dtype"]) for r in comm_section.rows}
    assert keys == {(m, k, d) for m in ("fedmvp-tiny", "ViT-B-16") for k in ("full", "lora_only")
                    for d in ("fp32", "fp16")}
    assert all(_is_flat(r) for r in comm_section.rows)
    for row in comm_section.rows:  # fp16 halves the tensor bytes; the Flower record adds names and shapes
        assert row["bytes"] == row["parameters"] * (4 if row["dtype"] == "fp32" else 2)
        assert row["flower_bytes"] > row["bytes"]


def test_comm_ratios_and_the_papers_figure(comm_section: Section) -> None:
    assert all(value > 1 for value in comm_section.ratios.values())
    assert round(comm_section.ratios["ViT-B-16 promptformer/lora params"], 2) == 267.08
    assert comm_section.goals[0].met is True
    json.dumps(comm_section.to_json())


def test_train_quick_rows_follow_the_plan(train_section: Section) -> None:
    assert train_section.config["model"] == "fedmvp-tiny"
    rows = [r for r in train_section.rows if "error" not in r]
    assert len(rows) == len(train_section.rows), [r.get("error") for r in train_section.rows]
    assert {r["batch"] for r in rows} == {2, 4}
    for batch in (2, 4):
        variants = {r["variant"]: r for r in rows if r["batch"] == batch}
        assert set(variants) == {"checkpointing off", "checkpointing auto", "-"}
        # the real code path chose the pieces: none without checkpointing, several with it
        assert variants["checkpointing off"]["segments"] == 1
        assert variants["checkpointing auto"]["segments"] > 1
        assert all(r["seconds_per_step"] > 0 and r["steps_timed"] == 1 for r in variants.values())
        assert all(r["peak_rss_mb"] > 0 for r in variants.values())
    assert all(_is_flat(r) for r in rows)
    assert len(train_section.goals) == 2
    json.dumps(train_section.to_json())


@pytest.mark.deployment
@pytest.mark.timeout(900)
def test_deploy_quick_runs_each_sites_messages_in_one_warm_process() -> None:
    """A real TLS deployment (serve + 2 joins): every message of a site ran in one process, and the
    steady round is measured against the same local training (issue 24 §5)."""
    from benchmarks import deploy

    section = deploy.run(Options(quick=True))
    assert section.config["warm_processes_per_site"] == [1, 1]  # CLIP and the data index loaded once per site
    assert all(tasks >= 3 for tasks in section.config["warm_tasks_per_site"])
    assert section.config["warm_failed_tasks"] == 0
    assert [r["kind"] for r in section.rows if r["runtime"] == "deployment (warm)"] == [
        "first (start-up)", "steady", "last (final evaluation)"]
    assert section.ratios["deploy_round_vs_local_train"] > 0
    assert section.ratios["objects_per_message"] == 3.0  # every message and reply: 3 objects in the SuperLink
    assert section.goals[0].target == "<= 1.3x"
    if sys.platform.startswith("linux"):  # where a steady round's CPU goes, by role (/proc)
        cpu = section.config["warm_cpu_seconds_per_steady_round"]
        assert cpu["site executors (training)"] > 0 and cpu["SuperLink"] > 0 and cpu["SuperNodes"] > 0
        assert section.config["warm_flwr_commands_during_steady_rounds"] == 0  # serve watches its run in-process
    json.dumps(section.to_json())


@pytest.mark.slow  # two deployments (sync, buffered) of throttled devices, each run to its end
@pytest.mark.deployment
@pytest.mark.timeout(1200)
def test_async_quick_runs_both_modes_on_throttled_devices() -> None:
    """Two real deployments of the same throttled devices (issue 26 §4): synchronous rounds, then buffered
    versions with as many device updates; every checkpoint's accuracy and time; the ratio's goal."""
    from benchmarks import async_rounds

    section = async_rounds.run(Options(quick=True))
    config = section.config
    # as many device updates in both runs
    assert config["slowdowns"] == list(async_rounds.SPEEDS["quick"]) == [1, 2]
    assert config["buffered_versions"] * config["buffer_size"] == config["sync_rounds"] * config["devices"]
    by_run = {name: [r for r in section.rows if r["runtime"] == name] for name in ("sync", "buffered")}
    # checkpoint 1 is the prepared start; the one after the measured rounds (final evaluation) is left out
    assert [r["round"] for r in by_run["sync"]] == list(range(1, config["sync_rounds"] + 2))
    assert [r["round"] for r in by_run["buffered"]] == list(range(1, config["buffered_versions"] + 2))
    for rows in by_run.values():
        assert rows[0]["seconds"] == 0 and all(0 <= r["accuracy"] <= 1 for r in rows)
        assert [r["seconds"] for r in rows] == sorted(r["seconds"] for r in rows)
    assert "buffered_vs_sync_time_to_accuracy" in section.ratios
    assert section.goals[0].target == ">= 2x"
    json.dumps(section.to_json())


def test_edge_agreement_without_an_ort_fp32_runtime_is_empty():
    """--device cuda where ONNX Runtime has no CUDA provider: the torch rows stand, no KeyError."""
    import numpy as np

    from benchmarks.edge import agreement

    assert agreement({"torch_plain": lambda pixels: [pixels]}, np.zeros((2, 3), dtype=np.float32)) == {}
