"""An open federation's run after the fact: `fedmvp evaluate` and `fedmvp ingest` on a run whose server
holds no site data (issue 24 follow-up).

The run is made without a simulation or processes: the deployed ServerApp's loop (``run_server``) drives
two open sites whose ClientApp (``node_app.client_app``, the one every SuperNode runs) is called in this
process by ``AppGrid``; two rounds, evaluated by the sites only at the last (eval_every 0), so round 1
has no metrics on the server.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from flwr.app import Context, Message, RecordDict

from fedmvp_formats import messages as schema

from fedmvp_apps.cli.evaluate import evaluate
from fedmvp_apps.cli.ingest import ingest
from tests.site_trees import site_preset, world_classes

SITES = ("b", "a")  # the order they first identify: b gets id 0, a id 1


class AppGrid:
    """A Grid whose nodes are ClientApps called in this process: node id -> its Context."""

    def __init__(self, contexts: dict[int, Context]):
        self.contexts, self._replies, self._sent = contexts, [], 0

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        from node_app.client_app import app

        ids = []
        for msg in messages:
            self._sent += 1
            msg.metadata.__dict__["_message_id"] = f"message-{self._sent}"
            reply = app(msg, self.contexts[msg.metadata.dst_node_id])
            reply.metadata._src_node_id = msg.metadata.dst_node_id
            self._replies.append(reply)
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, ids):
        pulled = [r for r in self._replies if r.metadata.reply_to_message_id in ids]
        self._replies = [r for r in self._replies if r.metadata.reply_to_message_id not in ids]
        return pulled


def site_context(node: int, preset: Path, name: str) -> Context:
    """What `fedmvp join --data sites/NAME --name NAME` gives its SuperNode (node config)."""
    return Context(run_id=1, node_id=node, node_config={schema.SITE_NAME: name, "data": str(site_folder(preset, name)),
                                                        "preset": str(preset)}, state=RecordDict(), run_config={})


def site_folder(preset: Path, name: str) -> Path:
    return preset.parent / "sites" / name


@pytest.fixture(scope="module")
def served(tmp_path_factory, small_world) -> Path:
    """An open run served to two sites in this process; the run directory (its preset beside it)."""
    from flwr.supercore.task_identity import TaskIdentity

    from fedmvp.federated.prepare import prepare_run
    from fedmvp.federated.server_app import ServerSettings, run_server

    root = tmp_path_factory.mktemp("open-run")
    seen, held = world_classes(small_world)
    preset = site_preset(root, small_world, {"a": seen[:2] + held[:1], "b": seen[2:4]}, held[:1], listed=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FEDMVP_TEXT_CACHE", str(root / "text-cache"))
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # as a ClientApp process has it
        run = prepare_run(str(preset), str(root / "run"), None, resume=False, device="cpu", with_data=False)
        grid = AppGrid({10 + i: site_context(10 + i, preset, name) for i, name in enumerate(SITES)})
        run_server(grid, ServerSettings(run_dir=str(run.path), progress=False, overrides={"min_nodes": 2}))
    return run.path


@pytest.fixture
def run(served, tmp_path) -> Path:
    """A copy of the served run (a test may write to it); its preset stays where the run records it."""
    target = tmp_path / "run"
    shutil.copytree(served, target)
    return target


def preset_of(run: Path) -> Path:
    from fedmvp.runs import RunDir

    return Path(RunDir(run).read_config()["preset_path"])


def cli(command, *args: str):
    return CliRunner().invoke(command, [str(a) for a in args])


def evaluated(run: Path, *args: str) -> dict:
    result = cli(evaluate, "--run", run, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


# ---- fedmvp evaluate -----------------------------------------------------------------------------------
def test_the_served_run_is_open_and_evaluated_only_at_its_last_round(served):
    assert [s["name"] for s in json.loads((served / "sites.json").read_text())["sites"]] == list(SITES)
    rows = [json.loads(line) for line in (served / "metrics.jsonl").read_text().splitlines()]
    assert "hm" not in rows[0] and rows[1]["hm"] is not None and rows[1]["eval_sites"] == 2


def test_a_round_the_sites_did_not_evaluate_is_one_line_and_exit_2_without_data(served):
    result = cli(evaluate, "--run", served, "--round", 1)
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {served}: round 1 was not evaluated"), lines
    assert "sites hold it" in lines[0] and f"--round 1 --data DIR" in lines[0] and "--eval-every" in lines[0]
    assert not (served / "round-0001" / "metrics.json").exists()  # nothing was written
    # the evaluated round: what the sites reported, with how many sites each metric is a mean over
    recorded = json.loads((served / "round-0002" / "state.json").read_text())["metrics"]
    shown = evaluated(served, "--round", 2)
    assert shown["tuned"] == {k: recorded[k] for k in shown["tuned"]}
    assert shown["zero-shot"] == {k: json.loads((served / "zero_shot.json").read_text()).get(k)
                                  for k in shown["zero-shot"]}
    assert (shown["tuned"]["local_sites"], shown["tuned"]["new_sites"]) == (2, 1)
    table = cli(evaluate, "--run", served, "--round", 2)
    assert table.exit_code == 0 and "tuned" in table.output and "folder" not in table.output


def _site_counts(result: dict, name: str) -> dict[str, tuple[int, int]]:
    """A site's --data counts keyed as its node's reply keys them (its sets' names)."""
    return {("local" if kind == "local" else f"clinics/{kind}/{name}"): tuple(pair)
            for kind, pair in result["counts"]["tuned"].items()}


def test_data_evaluates_a_round_on_one_sites_folder_as_that_site_does(served):
    """Round 2 as the server recorded it (from the sites' evaluate replies) is the combination of
    `fedmvp evaluate --data` on each site's folder; round 1, never evaluated, is evaluated there."""
    from fedmvp.data.federation_plan import plan_record
    from fedmvp.federated.metrics import combine_counts
    from fedmvp.runs import RunDir

    preset = preset_of(served)
    per_site = {site: evaluated(served, "--round", 2, "--data", site_folder(preset, name), "--name", name)
                for site, name in enumerate(SITES)}
    record = plan_record(RunDir(served).preset(), list(SITES))
    combined = combine_counts(record, {site: _site_counts(per_site[site], name) for site, name in enumerate(SITES)})
    recorded = json.loads((served / "round-0002" / "state.json").read_text())["metrics"]
    assert combined == {k: recorded[k] for k in combined}
    a = per_site[1]
    assert a["site"]["name"] == "a" and a["site"]["eval_fraction"] == 0.2
    # 2 base classes, 4 images each: 1 of each held out; the new class's 4 images are all evaluated
    assert a["site"]["images"] == {"local": 2, "base": 2, "new": 4}
    assert per_site[0]["site"]["images"] == {"local": 2, "base": 2}  # b holds no new class: adds nothing to New
    one = evaluated(served, "--round", 1, "--data", site_folder(preset, "a"))
    assert one["round"] == 1 and one["tuned"]["hm"] is not None
    assert one["zero-shot"] == a["zero-shot"]  # the frozen CLIP: the same on either round


def test_data_counts_equal_the_sites_own_evaluate_handler(served):
    """Round 1's weights: `--data` gives the counts site a's ClientApp replies to the server's evaluate message."""
    from flwr.supercore.task_identity import TaskIdentity

    from node_app.client_app import app
    from fedmvp.data.federation_plan import plan_record
    from fedmvp.federated.metrics import evaluation_sites
    from fedmvp.federated.wire import array_record, content_records, instruction_content, to_numpy_state
    from fedmvp.runs import RunDir

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    run, preset = RunDir(served), preset_of(served)
    instruction = schema.Instruction(round=1, run_id=run.read_config()["run_id"], preset=str(preset), device="cpu",
                                     method=run.method().to_dict(), prompted=True, site=1,
                                     assignment=evaluation_sites(plan_record(run.preset(), list(SITES))))
    state = to_numpy_state(run.load_checkpoint(1).tensors)
    message = Message(content=instruction_content(array_record(state), instruction), message_type="evaluate",
                      dst_node_id=11)
    reply = app(message, site_context(11, preset, "a"))
    metrics = content_records(reply.content)[schema.METRICS]
    shown = evaluated(served, "--round", 1, "--data", site_folder(preset, "a"))
    expected = _site_counts(shown, "a")
    assert schema.count_sets(metrics) == set(expected)
    assert {name: schema.count_pair(metrics, name) for name in expected} == expected


def test_eval_fraction_changes_the_held_out_share(served):
    folder = site_folder(preset_of(served), "a")
    default = evaluated(served, "--round", 1, "--data", folder)
    half = evaluated(served, "--round", 1, "--data", folder, "--eval-fraction", 0.5)
    assert half["site"]["eval_fraction"] == 0.5
    assert (default["site"]["images"]["local"], half["site"]["images"]["local"]) == (2, 4)
    assert half["counts"] != default["counts"]
    table = cli(evaluate, "--run", served, "--round", 1, "--data", folder, "--eval-fraction", 0.5, "--name", "a")
    assert table.exit_code == 0, table.output
    assert f"on site a's folder {folder}" in table.output and "held-out images: local 4, base 4, new 4" in table.output
    named = evaluated(served, "--round", 1, "--data", folder, "--name", "st-marys")  # a label in an open run
    assert named["site"]["name"] == "st-marys" and named["counts"] == default["counts"]


def test_a_bad_folder_or_option_is_one_line_and_exit_2(served, tmp_path):
    folder = tmp_path / "site"
    shutil.copytree(site_folder(preset_of(served), "b"), folder)
    (folder / "zebra").mkdir()
    (folder / "zebra" / "x.jpg").write_bytes(b"")
    result = cli(evaluate, "--run", served, "--round", 1, "--data", folder)
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {folder / 'zebra'}: class 'zebra' is not in the "
                                                   f"federation's class set"), lines
    shutil.rmtree(folder / "zebra")
    empty = folder / sorted(p.name for p in folder.iterdir())[0]
    shutil.rmtree(empty)
    empty.mkdir()
    result = cli(evaluate, "--run", served, "--data", folder)
    assert result.exit_code == 2 and result.output.strip() == f"error: {empty}: empty class folder (no images)"
    result = cli(evaluate, "--run", served, "--eval-fraction", 0.5)
    assert result.exit_code == 2 and "give it with --data DIR" in result.output


# ---- fedmvp ingest ---------------------------------------------------------------------------------------
def test_an_edge_update_is_ingested_into_an_open_run(run, tmp_path):
    """A device's update file (the device's writer, on a bundle of round 2 of this run) becomes round 3:
    its LoRA, the rest round 2's; the file recorded, no site claimed to have trained it, the sites' ids kept."""
    from fedmvp.runs import RunDir
    from tests.federated.test_ingest import classes_of, good_update, lora_of, round_promptformer

    before = lora_of(run, 2)
    run_id = RunDir(run).read_config()["run_id"]
    sites_json = (run / "sites.json").read_text()
    update = good_update(tmp_path / "device.safetensors", before, 0.01, 9, 1.25, round_number=2, run_id=run_id,
                         promptformer=round_promptformer(run, 2), classes=classes_of(run))
    result = cli(ingest, "--run", run, update, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["round"] == 3
    written = RunDir(run).load_checkpoint(3)
    after = lora_of(run, 3)
    for i, name in enumerate(sorted(before)):  # one fresh update, server_lr 1: the round's LoRA is the update's
        np.testing.assert_allclose(after[name], before[name] + 0.01 * (i + 1), rtol=0, atol=1e-6)
    previous = RunDir(run).load_checkpoint(2).tensors
    assert all(np.array_equal(written.tensors[k].numpy(), previous[k].numpy())
               for k in previous if not k.startswith("lora."))
    state = written.state
    assert state["source"] == "ingest" and state["ingested_onto"] == 2
    assert [(r["accepted"], r["num_examples"], r["bundle_round"]) for r in state["ingest"]] == [(True, 9, 2)]
    assert state["ingest"][0]["bundle_id"] and state["ingest"][0]["sha256"]
    # round 2's sites did not train round 3: none is recorded for it (their ids stay in sites.json)
    assert state["sites"] == [] and state["replies"] == [] and state["rejected"] == []
    assert (run / "sites.json").read_text() == sites_json
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert (row["round"], row["source"], row["examples"]) == (3, "ingest", 9)
    # the ingested round is evaluated where a site's data is, never on the server
    result = cli(evaluate, "--run", run, "--round", 3)
    assert result.exit_code == 2 and "round 3 was written by fedmvp ingest" in result.output
    assert "--eval-every" not in result.output
    shown = evaluated(run, "--round", 3, "--data", site_folder(preset_of(run), "a"))
    assert shown["round"] == 3 and shown["site"]["images"]["local"] == 2
