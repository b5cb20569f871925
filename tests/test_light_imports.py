"""What a command's parent process needs only to check and launch imports no torch, open_clip or peft
(5 CPU-seconds an interpreter): `fedmvp join` of a [[datasets]] site, a resumed `fedmvp serve`, any
reader of a run's records. The processes that train and aggregate import them; these need not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.deadlines import scaled

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "open_clip", "peft", "transformers")
CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
{body}
print(",".join(sorted(name for name in {heavy!r} if name in sys.modules)))
"""

ROWS = {
    "a run's records": "from fedmvp.runs import RunDir, RunError",
    "a run's preparation, as a resumed serve checks it": "from fedmvp.federated.prepare import check_same_preset",
    "the backbone's error, as join and serve catch it": "from fedmvp.clip_errors import ClipLoadError",
    "join's checks of a [[datasets]] site": (
        "from fedmvp.presets.schema import load_preset\n"
        "from fedmvp.vocabulary_check import check_preset\n"
        "from fedmvp_apps.cli.join import site_node_config\n"
        "from fedmvp_apps.deploy.supernode import supernode_command\n"
        "assert check_preset(load_preset('demo', check_roots=False)) is None\n"
        "supernode_command('127.0.0.1:9092', site_node_config('demo', 0), insecure=True)"),
}


@pytest.mark.processes  # a fresh interpreter: this one has torch already
@pytest.mark.parametrize("row", ROWS)
def test_checking_and_launching_import_no_model_library(row: str) -> None:
    child = CHILD.format(body=ROWS[row], heavy=HEAVY)
    done = subprocess.run([sys.executable, "-c", child, str(REPO)], capture_output=True, text=True,
                          timeout=scaled(60))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"{row} imported {done.stdout.strip()}"


def test_the_backbone_error_is_one_class() -> None:
    from fedmvp.clip import ClipLoadError as from_clip
    from fedmvp.clip_errors import ClipLoadError

    assert from_clip is ClipLoadError
