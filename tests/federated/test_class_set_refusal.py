"""A site whose attribute file is not the run's is refused before it trains (docs/security.md): `fedmvp serve`
on a [federation] preset, one `fedmvp join --data` site whose copy of attributes.json lists the same classes
in another order. Its labels would be other indices under the run's names; it refuses the server's first
message with one line naming what differs and the first differing class (no traceback), and no round is
written."""

from __future__ import annotations

import json
import shutil

import pytest

from fedmvp_apps.deploy.supernode import free_port
from tests.federated.processes import Processes
from tests.site_trees import site_preset, world_classes

pytestmark = pytest.mark.deployment  # starts a federation (see pyproject.toml markers)


@pytest.mark.timeout(600)
def test_a_site_with_the_classes_in_another_order_is_refused_before_it_trains(tmp_path, small_world):
    seen, held = world_classes(small_world)
    preset = site_preset(tmp_path, small_world, {"north-ward": seen[:2]}, [], rounds=1, listed=False)
    site = tmp_path / "site-machine"  # the site's own copy of the preset, its attribute file reordered
    site.mkdir()
    shutil.copy(preset, site / preset.name)
    attributes = json.loads((tmp_path / "attributes.json").read_text())
    (site / "attributes.json").write_text(json.dumps(dict(reversed(list(attributes.items())))))
    port, run = free_port(), tmp_path / "runs" / "open"
    procs = Processes(tmp_path)
    try:
        procs.start("serve", ["serve", "--config", str(preset), "--run-dir", str(run), "--insecure", "--address",
                              f"127.0.0.1:{port}", "--min-nodes", "1", "--round-timeout", "60", "--json"])
        procs.start("north-ward", ["join", "--superlink", f"127.0.0.1:{port}", "--insecure", "--config",
                                   str(site / preset.name), "--data", str(tmp_path / "sites" / "north-ward"),
                                   "--name", "north-ward", "--threads", "1"])
        procs.wait_for("the site's refusal", lambda: "refused before training" in procs.log("north-ward"), 300)
    finally:
        procs.stop()
    lines = [line for line in procs.log("north-ward").splitlines() if "refused before training" in line]
    assert f"other class order (class 0 is {seen[1]} here, {seen[0]} in the run)" in lines[0], lines[0]
    assert "copy the run's attribute file" in lines[0] and "attributes.json" in lines[0]
    assert "--classes-from-server" in lines[0]  # the other way to the run's class set
    assert "Traceback" not in procs.log("north-ward"), procs.log("north-ward")[-3000:]  # one line, not a crash
    assert not (run / "round-0001").exists()  # nothing of the site was trained or averaged
