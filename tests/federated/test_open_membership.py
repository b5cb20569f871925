"""Open membership (docs/architecture.md): a [federation] preset without [[sites]]. A site joins by its name; the
server numbers each new name in order of first appearance and keeps the numbering in RUN/sites.json,
so a restarted server and a rejoining site keep their id. Two live nodes of one name are both left out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedmvp_formats import messages as schema
from fedmvp_formats.messages import Instruction, MessageError

from fedmvp.federated.sampling import IDENTIFY, sample_among, sample_sites
from fedmvp.federated.site_registry import REGISTRY_FILE, SiteRegistry, SiteRegistryError
from fedmvp.federated.strategy import FedMVPStrategy, RoundPolicy, StrategyOptions
from fedmvp.federated.wire import array_record, content_records, instruction_content, records_content, state_records
from fedmvp.presets.server import ServerSpec
from tests.deadlines import scaled
from tests.site_trees import site_preset, world_classes

RUN = "run-1"


@pytest.fixture(autouse=True)
def _flower_run_identity():
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield


@pytest.fixture
def open_preset(tmp_path, small_world) -> Path:
    """Sites a and b's folders, and a preset that lists no site."""
    seen, held = world_classes(small_world)
    preset = site_preset(tmp_path, small_world, {"a": seen[:2] + held[:1], "b": seen[2:4]}, held[:1], listed=False)
    assert "[[sites]]" not in preset.read_text()
    return preset


# ---- the registry ------------------------------------------------------------------------------------
def test_new_names_are_numbered_in_order_of_first_appearance_and_kept_across_a_restart(tmp_path):
    registry = SiteRegistry.load(tmp_path, RUN)
    assert registry.names == [] and not (tmp_path / REGISTRY_FILE).exists()
    assert [registry.register(name) for name in ("clinic-b", "clinic-a", "clinic-b")] == [0, 1, 0]
    restarted = SiteRegistry.load(tmp_path, RUN)  # a resumed server reads what the first one wrote
    assert restarted.names == ["clinic-b", "clinic-a"] and restarted.id_of("clinic-a") == 1
    assert restarted.register("clinic-a") == 1 and restarted.register("clinic-c") == 2
    record = json.loads((tmp_path / REGISTRY_FILE).read_text())
    assert record["run_id"] == RUN and record["sites"] == [{"id": 0, "name": "clinic-b"}, {"id": 1, "name": "clinic-a"},
                                                          {"id": 2, "name": "clinic-c"}]
    with pytest.raises(SiteRegistryError, match="1 to 128 characters"):
        restarted.register("  ")
    assert SiteRegistry.load(tmp_path, RUN).names == ["clinic-b", "clinic-a", "clinic-c"]


def _entry(i: int, name: object) -> dict:
    return {"id": i, "name": name}


@pytest.mark.parametrize("record, problem", [
    ("{", "unreadable site registry"),
    ({"format": "other"}, "not a fedmvp-sites record"),
    ({"format": "fedmvp-sites", "version": 2, "run_id": RUN, "sites": []}, "version 2"),
    ({"format": "fedmvp-sites", "version": 1, "run_id": "other", "sites": []}, "of run 'other'"),
    ({"format": "fedmvp-sites", "version": 1, "run_id": RUN, "sites": {}}, "sites must be a list"),
    ({"format": "fedmvp-sites", "version": 1, "run_id": RUN, "sites": [_entry(1, "a")]}, r"sites\[0\] must be"),
    ({"format": "fedmvp-sites", "version": 1, "run_id": RUN, "sites": [_entry(0, "a"), _entry(1, "a")]},
     "numbered twice"),
    ({"format": "fedmvp-sites", "version": 1, "run_id": RUN, "sites": [_entry(0, "")]}, "1 to 128 characters"),
    ({"format": "fedmvp-sites", "version": 1, "run_id": RUN, "sites": [_entry(True, "a")]}, r"sites\[0\] must be"),
])
def test_a_malformed_registry_is_one_line_naming_the_file(tmp_path, record, problem):
    path = tmp_path / REGISTRY_FILE
    path.write_text(record if isinstance(record, str) else json.dumps(record))
    with pytest.raises(SiteRegistryError, match=problem) as err:
        SiteRegistry.load(tmp_path, RUN)
    assert str(err.value).startswith(f"{path}: ") and "\n" not in str(err.value)


def test_the_server_refuses_a_malformed_registry_before_any_round(tmp_path, open_preset, small_world):
    from fedmvp.federated.prepare import prepare_run
    from fedmvp.federated.server_app import open_membership
    from fedmvp.runs import RunError

    run = prepare_run(str(open_preset), str(tmp_path / "run"), None, resume=False, device="cpu", with_data=False)
    config = run.read_config()
    # no site is recorded yet, and the class set is the attribute file's (what an export bakes in)
    assert config["federation"] == {"clients": [], "evaluations": []} and config["num_clients"] == 0
    assert [c["name"] for c in json.loads((run.path / "classes.json").read_text())["classes"]][-1] == \
        world_classes(small_world)[1][0]
    sites = open_membership(run, run.preset(), config["run_id"])
    assert sites.registry.register("x") == 0
    assert [c["name"] for c in sites.record()["clients"]] == ["x"]
    (run.path / REGISTRY_FILE).write_text("[]")
    with pytest.raises(RunError, match=f"{run.path / REGISTRY_FILE}: not a fedmvp-sites record"):
        open_membership(run, run.preset(), config["run_id"])


# ---- who a node is, and what the server makes of it ----------------------------------------------------
def _context(preset: Path, name: str, data: Path) -> Context:
    return Context(run_id=1, node_id=7, node_config={schema.SITE_NAME: name, "data": str(data), "preset": str(preset)},
                   state=RecordDict(), run_config={})


def test_an_open_site_identifies_by_name_and_trains_under_the_id_its_message_carries(open_preset):
    from node_app.client_app import app
    from fedmvp.federated.client_app import _site

    context = _context(open_preset, "a", open_preset.parent / "sites" / "a")
    content = instruction_content(ArrayRecord(), Instruction(round=4, run_id=RUN, preset=str(open_preset)))
    reply = app(Message(content=content, message_type=IDENTIFY, dst_node_id=7), context)
    identity = content_records(reply.content)[schema.IDENTITY]
    assert identity[schema.PARTITION_ID] == schema.UNNUMBERED and identity[schema.SITE_NAME] == "a"
    with pytest.raises(MessageError, match="no site"):  # train and evaluate need the id the server gave
        _site(context, str(open_preset), Instruction(round=4, run_id=RUN))
    site, name, request = _site(context, str(open_preset), Instruction(round=4, run_id=RUN, site=3))
    assert (site, name, request.site) == (3, "a", 3)
    from fedmvp.data.federation import load_federation

    _, federation = load_federation(str(open_preset), request)  # the site's own part, under the server's id
    assert [c.client_id for c in federation.clients] == [3]
    assert {e.name for e in federation.evaluations} == {"clinics/base/a", "clinics/new/a"}


class NameGrid:
    """A Grid whose nodes identify by name (an open federation's sites): ``names`` node id -> name."""

    def __init__(self, names: dict[int, str]):
        self.names, self.asked = names, []

    def get_node_ids(self):
        return list(self.names)

    def push_messages(self, messages):
        self._replies = []
        for msg in messages:
            assert msg.metadata.message_type == IDENTIFY
            node, config = msg.metadata.dst_node_id, content_records(msg.content)["config"]
            self.asked.append(node)
            msg.metadata.__dict__["_message_id"] = f"query-{node}"
            reply = Message(records_content({"identity": {
                "partition-id": schema.UNNUMBERED, "site-name": self.names[node], "round": config["round"],
                "run-id": config["run-id"]}}), reply_to=msg)
            reply.metadata._src_node_id = node
            self._replies.append(reply)
        return [msg.metadata.message_id for msg in messages]

    def pull_messages(self, ids):
        pulled, self._replies = [r for r in self._replies if r.metadata.reply_to_message_id in ids], []
        return pulled


def _strategy(run, open_sites, min_nodes: int | None = None, fraction: float = 1.0) -> FedMVPStrategy:
    config = run.read_config()
    return FedMVPStrategy(StrategyOptions(client_config={"preset": "p"}, seed=3, total_rounds=2, base_lr=0.1, num_clients=0,
                          run_id=config["run_id"], federation=config["federation"], open_sites=open_sites,
                          policy=RoundPolicy(fraction, ServerSpec(min_nodes=min_nodes, node_wait=0.1))))


def _reply(node: int, site: int, name: str, run_id: str, classes: dict[str, int]) -> Message:
    n = sum(classes.values())
    metrics = {"num-examples": n, "train-loss": 0.5, "lora-active": 0, "switch-next": 0}
    identity = {"partition-id": site, "site-name": name, "round": 1, "run-id": run_id}
    message = Message(content=records_content({**state_records({"promptformer.w": np.ones(2, np.float32) * site}),
                                               "metrics": metrics, "identity": identity, "classes": classes}),
                      dst_node_id=1, message_type="train")
    message.metadata._src_node_id = node
    return message


def test_the_server_numbers_names_sends_each_node_its_id_and_leaves_out_two_nodes_of_one_name(tmp_path, open_preset):
    from fedmvp.federated.prepare import prepare_run
    from fedmvp.federated.server_app import open_membership

    run = prepare_run(str(open_preset), str(tmp_path / "run"), None, resume=False, device="cpu", with_data=False)
    run_id = run.read_config()["run_id"]
    strategy = _strategy(run, open_membership(run, run.preset(), run_id), min_nodes=2)
    grid = NameGrid({21: "clinic-z", 22: "clinic-y", 23: "clinic-z"})  # 23: a second live node named clinic-z
    messages = strategy.configure_train(1, array_record({"promptformer.w": np.zeros(2, np.float32)}), ConfigRecord(),
                                        grid)
    # numbered in order of first appearance (node order here), persisted before any work is sent
    assert json.loads((run.path / REGISTRY_FILE).read_text())["sites"] == [{"id": 0, "name": "clinic-z"},
                                                                           {"id": 1, "name": "clinic-y"}]
    sent = {m.metadata.dst_node_id: content_records(m.content)["config"][schema.SITE_ID] for m in messages}
    assert sent == {21: 0, 22: 1, 23: 0}
    assert strategy.site_names == {0: "clinic-z", 1: "clinic-y"} and strategy.num_clients == 2
    assert {e["name"] for e in strategy.federation["evaluations"]} == {f"clinics/{k}/{n}" for k in ("base", "new")
                                                                      for n in ("clinic-z", "clinic-y")}
    base = strategy.federation["clients"][0]["classes"][0]
    replies = [_reply(21, 0, "clinic-z", run_id, {base: 3}), _reply(23, 0, "clinic-z", run_id, {base: 4}),
               _reply(22, 1, "clinic-y", run_id, {base: 5}), _reply(22, 0, "clinic-y", run_id, {base: 5})]
    arrays, _ = strategy.aggregate_train(1, replies[:3])
    assert arrays is None  # two nodes of clinic-z: both left out, and one usable reply of the two needed
    assert {r["reason"] for r in strategy.rejected} == {"more than one node replied for this site"}
    # a node cannot take another name's id: its reply's name must be that site's
    strategy.aggregate_train(1, [replies[3]])
    assert "is not site 0's" in strategy.rejected[0]["reason"]
    # a restarted server reads the numbering: a rejoining node of clinic-y (a new node id) keeps id 1
    restarted = _strategy(run, open_membership(run, run.preset(), run_id))
    assert restarted.site_names == {0: "clinic-z", 1: "clinic-y"}
    messages = restarted.configure_train(1, array_record({"promptformer.w": np.zeros(2, np.float32)}),
                                         ConfigRecord(), NameGrid({40: "clinic-y", 41: "clinic-x"}))
    assert {m.metadata.dst_node_id: content_records(m.content)["config"][schema.SITE_ID] for m in messages} == {40: 1, 41: 2}
    arrays, metrics = restarted.aggregate_train(1, [_reply(40, 1, "clinic-y", run_id, {base: 5}),
                                                    _reply(41, 2, "clinic-x", run_id, {base: 2})])
    assert arrays is not None and metrics["clients"] == 2


def test_an_open_round_waits_for_min_nodes_then_samples_the_live_sites_by_the_round_seed(tmp_path, open_preset):
    from fedmvp.federated.prepare import prepare_run
    from fedmvp.federated.server_app import open_membership
    from fedmvp.federated.strategy import RoundFailed

    run = prepare_run(str(open_preset), str(tmp_path / "run"), None, resume=False, device="cpu", with_data=False)
    sites = open_membership(run, run.preset(), run.read_config()["run_id"])
    with pytest.raises(RoundFailed, match="only 1 of the 2 nodes"):
        _strategy(run, sites, min_nodes=2).configure_train(1, ArrayRecord(), ConfigRecord(), NameGrid({1: "a"}))
    strategy = _strategy(run, sites, fraction=0.5)
    grid = NameGrid({n: f"site-{n}" for n in range(10, 16)})
    for round_number in (1, 2, 3):
        messages = strategy.configure_train(round_number, ArrayRecord(), ConfigRecord(), grid)
        ids = sorted(content_records(m.content)["config"][schema.SITE_ID] for m in messages)
        # site 0 (a) is gone: the round draws among the six live ones (ids 1..6) as a listed federation of six
        # sites draws, by position
        assert ids == sample_among(3, 0.5, list(range(1, 7)), round_number) == \
            [i + 1 for i in sample_sites(3, 0.5, 6, round_number)]
        assert len(ids) == 3


# ---- the commands ----------------------------------------------------------------------------------------
def test_join_takes_any_name_checks_the_folder_and_passes_threads_to_the_sites_torch(open_preset, monkeypatch):
    from flwr.common.config import parse_config_args

    from fedmvp.federated import client_app
    from fedmvp_apps.cli.join import join
    from fedmvp_apps.deploy import supernode

    launched = []
    monkeypatch.setattr(supernode, "become_supernode", lambda args, **_: launched.append(args))
    folder = open_preset.parent / "sites" / "a"
    args = ["--superlink", "127.0.0.1:1", "--insecure", "--config", str(open_preset), "--data", str(folder),
            "--name", "never-listed", "--threads", "3"]
    result = CliRunner().invoke(join, args)
    assert result.exit_code == 0, result.output
    node_config = parse_config_args([launched[0][launched[0].index("--node-config") + 1]])
    assert node_config[schema.SITE_NAME] == "never-listed" and node_config[schema.THREADS] == 3
    # what the site's ClientApp does with that node config: torch trains and evaluates on 3 threads
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        client_app._threads(Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config={}),
                            Instruction(round=1, run_id=RUN, threads=2))  # a node's own threads win
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    other = open_preset.parent / "sites" / "b"
    (other / "zebra").mkdir()  # a class the federation does not have: one line, exit 2, nothing launched
    result = CliRunner().invoke(join, [*args[:6], str(other), "--name", "b"])
    assert result.exit_code == 2 and "zebra: class 'zebra' is not in the federation's class set" in result.output
    assert len(launched) == 1


@pytest.mark.processes  # a refusal (exit 2): no federation starts (tests/process_markers.py)
def test_train_needs_listed_sites_with_folders(tmp_path, open_preset):
    out = subprocess.run([sys.executable, "-m", "fedmvp_apps.cli", "train", "--config", str(open_preset),
                          "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=scaled(300))
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "simulation needs [[sites]] with their data folders" in lines[0], lines
