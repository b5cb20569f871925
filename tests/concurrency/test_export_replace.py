"""`fedmvp-export --force` replacing a bundle directory that a device is using.

An `edge-client infer` loading the bundle while it is replaced loads the whole new one (before: the
old manifest against the new files, a failed hash check). A train holding the bundle's lock makes
the export fail at once with one line naming it, the bundle untouched, and the train's
personalisation lands (before: the directory was replaced under the train, whose update then
belonged to neither bundle).
"""

from __future__ import annotations

from edge_client.bundle import read_bundle
from edge_client.lora_store import active_lora
from tests.concurrency.processes import APPLY, finish, leftovers, one_error_line, reached, run, start, train, unlocked
from tests.edge_client.edge_helpers import tree_bytes
import pytest

pytestmark = pytest.mark.processes  # starts real processes (see pyproject.toml markers)

CHECK_FILES = "edge_client.bundle:_check_files"  # where infer stops: the old manifest read, no file checked yet


def export(world, bundle) -> list[str]:
    return ["fedmvp-export", "--run", str(world / "runs" / "moved"), "--round", "2", "--out", str(bundle),
            "--force", "--parity-images", "32"]


def test_infer_loads_the_whole_new_bundle_when_export_replaces_it(bundle, world, tmp_path):
    gate = tmp_path / "gate"
    image = sorted((world / "data" / "test").rglob("*.png"))[0]
    infer = start(["edge-client", "infer", "--bundle", str(bundle), "--provider", "cpu", str(image)], tmp_path,
                  gate, CHECK_FILES)
    reached(gate, infer)  # it has read round 1's manifest
    exported = run(export(world, bundle), tmp_path)
    assert exported.returncode == 0, exported.stderr[-2000:]
    gate.touch()
    done = finish(infer)
    assert done.returncode == 0 and "error" not in done.stderr, done.stderr[-2000:]
    assert f"bundle: {bundle} (round 2, fp32)" in done.stderr and "1 classified, 0 failed" in done.stderr
    assert leftovers(tmp_path) == []


def test_export_refuses_a_bundle_a_train_holds(bundle, world, tmp_path):
    gate = tmp_path / "gate"
    trainer = start(train(bundle, world, tmp_path / "u1"), tmp_path, gate, APPLY)
    pid = reached(gate, trainer)
    before = unlocked(tree_bytes(bundle))
    refused = run(export(world, bundle), tmp_path)
    one_error_line(refused, f"{bundle / '.lock'}: bundle in use by pid {pid}", "(edge-client train)",
                   f"{bundle} was not replaced")
    assert unlocked(tree_bytes(bundle)) == before
    gate.touch()
    trained = finish(trainer)
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert read_bundle(bundle).round == 1 and active_lora(read_bundle(bundle)).personalised
    assert leftovers(tmp_path) == []
