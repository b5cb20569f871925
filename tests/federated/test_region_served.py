"""A region served as a buffered federation feeds the central run (docs/howto/regions.md), real processes
on 127.0.0.1, TLS on: `fedmvp region-start --rounds 2` from central round 2, `fedmvp serve --mode buffered`
resumed on the region with two `edge-client join` devices on bundles exported from the region, then
`fedmvp region-update` and the central `fedmvp ingest`.

- The region serves exactly its own budget: versions 3 and 4, then the serve exits 0.
- The devices train for the region: their bundles and update files name the region's run id, never the
  central run's.
- The region's update file counts the examples of the versions' replies (state.json ``replies[].examples``)
  and the central round 3 is theta_2 + server_lr * (L_4 - R_2): one file, staleness 0, weight 1.

The quick loop's twin (no processes): the real ``BufferedStrategy`` and its ``RoundWriter`` write the
region's versions (state.json as a served run writes them) from scripted device replies on a fake Grid,
with a ``server_lr`` of 0.5 in the central run (so the rule's factor is seen).
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from safetensors import safe_open

from tests.deadlines import scaled
from tests.federated.processes import ENV, FEDMVP, Processes
from tests.federated.test_aggregation import _flower_run_identity  # noqa: F401  (fixture: a Flower run id)
from tests.federated.test_edge_join import local_folder, prepare_run, states, update_files
from tests.federated.test_ingest import lora_of
from tests.federated.test_regions import central, central_base  # noqa: F401  (fixtures: the central run)


BUFFERED = """
[server]
concurrency = 2
buffer_size = 2
max_staleness = 20
round_timeout = 45
"""


def cli(*args: str) -> dict:
    done = subprocess.run([*FEDMVP, *args, "--json"], env=ENV, capture_output=True, text=True, timeout=scaled(120))
    assert done.returncode == 0, f"{args}\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout)


@pytest.mark.deployment  # starts a federation (see pyproject.toml markers)
@pytest.mark.timeout(600)
def test_a_served_buffered_region_enters_the_central_run_as_one_update(tmp_path, small_world):
    from edge_client.bundle import Bundle
    from export.bundle_writer import export_bundle
    from fedmvp_apps.deploy.supernode import free_port
    from fedmvp.runs import RunDir

    preset, central = prepare_run(tmp_path, small_world, 2, BUFFERED)  # rounds 1-2 done: the central run is complete
    region = tmp_path / "region"
    link = cli("region-start", "--central", str(central), "--round", "2", "--rounds", "2", "--out", str(region))
    assert (link["central_round"], link["rounds"]) == (2, 2)
    region_id, central_id = RunDir(region).read_config()["run_id"], RunDir(central).read_config()["run_id"]
    assert RunDir(region).read_config()["rounds"] == 4 and region_id != central_id
    bundles = {name: tmp_path / f"device-{name}" / "bundle" for name in "ab"}
    for bundle in bundles.values():
        export_bundle(region, 2, bundle)
        assert Bundle.open(bundle).run_id == region_id
    classes = Bundle.open(bundles["a"]).class_names
    data = {"a": local_folder(small_world, classes[:3], 4, tmp_path / "device-a" / "local"),
            "b": local_folder(small_world, classes[2:4], 4, tmp_path / "device-b" / "local")}
    certs = tmp_path / "certs"
    subprocess.run([*FEDMVP, "certs", "--out", str(certs)], check=True, capture_output=True, env=ENV)
    port = free_port()
    procs = Processes(tmp_path)
    try:
        procs.start_buffered(preset, region, certs, port, {name: (bundles[name], data[name]) for name in "ab"})
        assert procs.procs["serve"].wait(timeout=scaled(400)) == 0, procs.log("serve")[-3000:]
    finally:
        procs.stop()
    versions = states(region)
    assert sorted(versions) == [2, 3, 4]  # the region's budget, not the central run's rounds (2: nothing left)
    replies = [r for v in (3, 4) for r in versions[v]["replies"]]
    assert len(replies) == 4 and all(r["examples"] > 0 for r in replies)
    for name in "ab":  # the devices trained for the region, under its run id
        for path in update_files(tmp_path / f"device-{name}" / "updates"):
            with safe_open(str(path), "np") as handle:
                assert handle.metadata()["run_id"] == region_id

    made = cli("region-update", "--run", str(region), "--out", str(tmp_path / "region.st"))
    assert (made["rounds"], made["central_round"]) == ([3, 4], 2)
    assert made["examples"] == sum(r["examples"] for r in replies)
    report = cli("ingest", "--run", str(central), str(tmp_path / "region.st"))
    assert report["round"] == 3 and report["rejected"] == [], report
    assert [(r["num_examples"], r["staleness"]) for r in report["accepted"]] == [(made["examples"], 0)]
    theta, after, last, base = lora_of(central, 2), lora_of(central, 3), lora_of(region, 4), lora_of(region, 2)
    for name in theta:  # server_lr 1 (the default), one file of weight n s(0) / n = 1
        step = last[name].astype(np.float64) - base[name]
        np.testing.assert_allclose(after[name], theta[name] + step, rtol=0, atol=1e-5)
        assert np.abs(step).max() > 1e-4  # the region's devices moved it


# ---- in process: the buffered strategy's own record writer ---------------------------------------------
EXAMPLES = {7: 9, 8: 6}  # per device: what each of its replies counts


def test_buffered_versions_written_by_the_strategy_enter_the_central_run(central, tmp_path):
    from fedmvp.federated.buffered import BufferedStrategy
    from fedmvp.federated.ingest import ingest
    from fedmvp.federated.regions import region_start, region_update
    from fedmvp.federated.round_writer import RoundWriter
    from fedmvp.federated.strategy import RoundPolicy, StrategyOptions
    from fedmvp.federated.wire import array_record
    from fedmvp.presets.server import ServerSpec
    from fedmvp.runs import RunDir
    from tests.federated.test_ingest import configure

    configure(central, {"edge_max_examples": 100, "server_lr": 0.5})
    region = tmp_path / "region"
    region_start(central, region, 2, rounds=2)
    run = RunDir(region)
    region_id = run.read_config()["run_id"]
    server = ServerSpec(min_nodes=1, node_wait=5, concurrency=2, buffer_size=2, max_staleness=20)
    options = StrategyOptions(client_config={}, seed=0, total_rounds=run.read_config()["rounds"], base_lr=0.1,
                              num_clients=1, run_id=region_id, policy=RoundPolicy(1.0, server), round_offset=2)
    strategy = BufferedStrategy(options, RoundWriter(run, server, None), sleep=lambda s: None)
    strategy.evaluate_round = lambda grid, state, number: {}  # a due version's evaluation is not tested here
    initial = {k: v.numpy() for k, v in run.load_checkpoint(2).tensors.items()}
    strategy.start(ScriptedDevices(region_id, initial), array_record(initial), num_rounds=2)

    versions = {n: run.round_state(n) for n in run.rounds() if n > 2}
    assert sorted(versions) == [3, 4]
    replies = [r for state in versions.values() for r in state["replies"]]
    assert sorted(r["examples"] for r in replies) == [6, 6, 9, 9]
    made = region_update(region, tmp_path / "region.st")
    assert (made.rounds, made.examples) == ([3, 4], sum(r["examples"] for r in replies))
    assert ingest(central, [tmp_path / "region.st"]).round == 3
    theta, after = lora_of(central, 2), lora_of(central, 3)
    last, base = lora_of(region, 4), lora_of(region, 2)
    for name in theta:  # server_lr 0.5 times the one file's delta (weight n s(0) / n = 1)
        step = 0.5 * (last[name].astype(np.float64) - base[name])
        np.testing.assert_allclose(after[name], theta[name] + step, rtol=0, atol=1e-5)
        assert np.abs(step).max() > 1e-3


class ScriptedDevices:
    """Two edge devices on a fake Grid (the Grid calls ``grid_poll`` makes): each train message is answered
    at once with the LoRA it was sent plus a seeded step, for the region's run and the version's round."""

    def __init__(self, run_id: str, state: dict[str, np.ndarray]):
        from tests.federated.test_aggregation import SiteGrid

        self.ids = SiteGrid({node: "edge" for node in EXAMPLES})
        self.run_id, self.out, self.sent = run_id, {}, 0
        self.lora = {k: v for k, v in state.items() if k.startswith("lora.")}

    def get_node_ids(self):
        return self.ids.get_node_ids()

    def push_messages(self, messages):
        messages = list(messages)
        if messages and messages[0].metadata.message_type == "query.identify":  # who a node is
            return self.ids.push_messages(messages)
        ids = []
        for message in messages:
            self.sent += 1
            message.metadata.__dict__["_message_id"] = f"train-{self.sent}"
            self.out[f"train-{self.sent}"] = message
            ids.append(f"train-{self.sent}")
        return ids

    def pull_messages(self, ids):
        from flwr.app import Message

        from fedmvp.federated.wire import content_records
        from tests.federated.test_aggregation import edge_reply

        ids = list(ids)
        if any(i.startswith("query") for i in ids):
            return self.ids.pull_messages(ids)
        replies = []
        for message_id in ids:
            message = self.out.pop(message_id, None)
            if message is None:
                continue
            node, config = message.metadata.dst_node_id, content_records(message.content)["config"]
            rng = np.random.default_rng(int(message_id.split("-")[1]))
            lora = {k: (v + 0.01 * rng.normal(size=v.shape)).astype(np.float32) for k, v in self.lora.items()}
            sent = edge_reply(node, lora, EXAMPLES[node], digest=config["promptformer-digest"],
                              round_number=config["round"], run_id=self.run_id)
            answer = Message(content=sent.content, reply_to=message)
            answer.metadata._src_node_id = node
            replies.append(answer)
        return replies
