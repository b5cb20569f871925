"""A site that takes the run's class set from the server (`fedmvp join --classes-from-server`), in process:
the join needs no attribute file but still checks the folder; the site's ClientApp takes the names and
phrases from the message once they check against the record's digest, builds exactly what it builds with a
copy of the run's file, says so once, and refuses a round whose record does not check, or whose folder
or preset does not fit the run's set, with one line. The real processes: test_open_deployment.py."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from flwr.app import ArrayRecord, Context, Message, RecordDict

from fedmvp_formats import messages as schema
from fedmvp_formats.class_set import ClassSet
from fedmvp_formats.messages import Instruction

from fedmvp.federated.site_classes import FROM_SERVER, ClassSetMismatch
from fedmvp.federated.wire import instruction_content
from tests.site_trees import site_preset, world_classes

RUN = "run-1"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    monkeypatch.setenv("FEDMVP_CACHE", str(tmp_path / "cache"))  # where a taken class set is written


@pytest.fixture
def machines(tmp_path, small_world) -> tuple[Path, Path]:
    """The server's preset (beside its attributes.json) and a site machine's copy of it, with no attribute file."""
    seen, held = world_classes(small_world)
    server = site_preset(tmp_path, small_world, {"a": seen[:2] + held[:1], "b": seen[2:4]}, held[:1], listed=False)
    site = tmp_path / "site-machine" / server.name
    site.parent.mkdir()
    shutil.copy(server, site)
    return server, site


def _record(server: Path) -> dict:
    from fedmvp.presets.schema import load_preset
    from fedmvp.run_classes import class_set, class_set_classes

    return class_set(class_set_classes(load_preset(server, check_roots=False))).record()


def _context(site: Path, folder: Path) -> Context:
    node_config = {schema.SITE_NAME: "a", "data": str(folder), "preset": str(site), FROM_SERVER: True}
    return Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={})


def _instruction(record: dict | None) -> Instruction:
    return Instruction(round=1, run_id=RUN, preset="the server's path", site=0, class_set=record)


def test_join_needs_no_attribute_file_with_the_flag_and_still_checks_the_folder(machines, monkeypatch):
    from flwr.common.config import parse_config_args

    from fedmvp_apps.cli.join import join
    from fedmvp_apps.deploy import supernode

    server, site = machines
    launched = []
    monkeypatch.setattr(supernode, "become_supernode", lambda args, **_: launched.append(args))
    folder = server.parent / "sites" / "a"
    args = ["--superlink", "127.0.0.1:1", "--insecure", "--config", str(site), "--data", str(folder), "--name", "a"]
    refused = CliRunner().invoke(join, args)  # without the flag: the run's file is needed here
    assert refused.exit_code == 2 and "attributes.json" in refused.output and not launched
    result = CliRunner().invoke(join, [*args, "--classes-from-server"])
    assert result.exit_code == 0, result.output
    node_config = parse_config_args([launched[0][launched[0].index("--node-config") + 1]])
    assert node_config[FROM_SERVER] is True and node_config[schema.SITE_NAME] == "a"
    (folder / "zebra").mkdir()  # what the join can check without the class set, it checks: one line, exit 2
    result = CliRunner().invoke(join, [*args, "--classes-from-server"])
    assert result.exit_code == 2 and "zebra: empty class folder" in result.output and len(launched) == 1
    paper = CliRunner().invoke(join, ["--superlink", "127.0.0.1:1", "--insecure", "--config", "demo", "--site", "0",
                                      "--classes-from-server"])
    assert paper.exit_code == 2 and "need a [federation] preset" in paper.output


def test_the_site_uses_the_taken_class_set_exactly_as_a_copy_of_the_runs_file_and_says_so_once(machines, capsys):
    from fedmvp.attributes.files import load_attributes
    from fedmvp.data.federation import SiteRequest, load_federation
    from fedmvp.federated import client_app
    from node_app import client_app as node

    server, site = machines
    folder = server.parent / "sites" / "a"
    record, context = _record(server), _context(site, folder)
    classes = client_app._classes(context, str(site), _instruction(record))
    assert classes.digest == record["digest"] and Path(classes.attributes).name == f"{record['digest']}.json"
    taken = json.loads(Path(classes.attributes).read_text())
    assert taken == load_attributes(server.parent / "attributes.json")  # names in the run's order, its phrases
    _, request = client_app._site(context, str(site), _instruction(record))[1:]
    _, mine = load_federation(str(site), replace(request, attributes=classes.attributes))
    _, copy = load_federation(str(server), SiteRequest(name="a", data=str(folder), site=0))
    for got, want in [(mine.clients[0], copy.clients[0]), *zip(mine.evaluations, copy.evaluations)]:
        assert (got.class_names, got.attributes, got.style) == (want.class_names, want.attributes, want.style)
    assert mine.clients[0].train == copy.clients[0].train and len(mine.evaluations) == len(copy.evaluations) == 2

    msg = Message(content=instruction_content(ArrayRecord(), _instruction(record)), message_type="train",
                  dst_node_id=7)
    for _ in range(2):  # one line per class set taken, not per message
        assert node._site(lambda m, c: "reply", msg, context) == "reply"
    lines = [line for line in capsys.readouterr().out.splitlines() if "took the class set" in line]
    assert lines == [f"[fedmvp] took the class set from the server (digest {record['digest'][:12]}, 5 classes)"]


def _spoiled(record: dict, **changes) -> dict:
    return {**record, **changes}


@pytest.mark.parametrize("change, why", [
    (lambda r: _spoiled(r, digest="f" * 64), "digest is not the digest of its classes"),
    (lambda r: _spoiled(r, texts=["tampered", *r["texts"][1:]]), "phrases of class .* are not the ones its digest"),
    (lambda r: {k: v for k, v in r.items() if k not in ("texts", "counts")}, "carries no attribute phrases"),
    (lambda r: _spoiled(r, counts=[2 ** 40, *r["counts"][1:]]), "not one count of 0 to 1000 phrases"),
    (lambda r: _spoiled(r, texts=list(range(len(r["texts"])))), "texts are not 50 phrases"),
    (lambda r: _spoiled(r, counts=[str(c) for c in r["counts"]]), "not one count"),
    (lambda r: None, "carries no class set to take"),
])
def test_a_record_that_does_not_check_refuses_the_round_with_one_line(machines, capsys, change, why):
    from fedmvp_formats.files import cache_root

    from node_app.client_app import train

    server, site = machines
    context = _context(site, server.parent / "sites" / "a")
    msg = Message(content=instruction_content(ArrayRecord(), _instruction(change(_record(server)))),
                  message_type="train", dst_node_id=7)
    reply = train(msg, context)  # an error reply with the line, not a traceback in the site's log
    assert reply.has_error() and re.search(why, reply.error.reason) and "\n" not in reply.error.reason
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("[fedmvp] round 1: refused train (the server's message"), lines
    assert not (cache_root() / "classes").exists()  # nothing of it was written, let alone used


def test_a_folder_or_preset_that_does_not_fit_the_taken_set_is_one_line(machines, tmp_path, small_world):
    from fedmvp.federated import client_app
    from fedmvp.federated.site_classes import site_classes
    from fedmvp.model import FedMVPConfig

    server, site = machines
    record = _record(server)
    folder = server.parent / "sites" / "b"
    shutil.copytree(folder / world_classes(small_world)[0][2], folder / "zebra")  # a class the run has not
    context = _context(site, folder)
    classes = client_app._classes(context, str(site), _instruction(record))
    _, _, request = client_app._site(context, str(site), _instruction(record))
    with pytest.raises(ClassSetMismatch) as refused:
        client_app._context(str(site), Instruction(round=1, run_id=RUN, method=FedMVPConfig().to_dict(), site=0),
                            request, classes)
    assert "this site's folder does not fit the class set of run run-1: " in str(refused.value)
    assert "zebra: class 'zebra' is not in the federation's class set (5 classes)" in str(refused.value)
    for k, why in [(2, "is not what this preset makes of it: other attribute phrases"),
                   (20, "does not fit this preset: .*fewer than 20 phrases")]:
        other = tmp_path / f"k{k}" / site.name  # a site whose preset cuts the phrases otherwise than the run
        other.parent.mkdir()
        other.write_text(site.read_text().replace("lora_rank = 4", f"lora_rank = 4\nnum_attributes = {k}"))
        with pytest.raises(ClassSetMismatch, match=why) as refused:
            site_classes(str(other), _instruction(record), from_server=True)
        assert "\n" not in str(refused.value)
