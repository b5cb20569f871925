"""`fedmvp attributes generate --preset` against a shipped preset (offline templates)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from fedmvp_apps.cli import main
from fedmvp.data.catalog import preset_class_names


def test_offline_attributes_for_every_class_of_the_demo_preset(tmp_path):
    out = tmp_path / "demo.json"
    result = CliRunner().invoke(main, ["attributes", "generate", "--preset", "demo", "--offline",
                                       "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    classes = preset_class_names("demo")
    assert [k for k in data if k != "_meta"] == classes and len(classes) == 40
    assert all(len(data[c]) == 10 for c in classes)
    assert data["_meta"]["offline_classes"]
