"""The inference path needs no torch: `edge-client infer` in a process where `import torch` fails."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
from edge_helpers import REPO

from edge_client.bundle import read_bundle
from edge_client.lora_store import apply_update
from edge_client.update import write_update
import pytest
from tests.deadlines import scaled

pytestmark = pytest.mark.processes  # starts real processes (see pyproject.toml markers)

SCRIPT = textwrap.dedent("""
    import importlib.abc, json, sys

    class BlockTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, BlockTorch())
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the block did not work")

    from fedmvp_apps.edge_cli import main

    codes = {}
    for name, args in json.loads(sys.argv[1]).items():
        try:
            main(args, standalone_mode=False)
            codes[name] = 0
        except SystemExit as exit:
            codes[name] = exit.code
    leaked = sorted(m for m in sys.modules
                    if m == "torch" or m.startswith("torch.") or m in ("fedmvp", "export", "open_clip"))
    print("RESULT " + json.dumps({"codes": codes, "leaked": leaked}))
""")


def test_infer_runs_where_torch_cannot_be_imported(edge_bundle, data_root, tmp_path):
    bundle_path = tmp_path / "bundle"
    shutil.copytree(edge_bundle, bundle_path)
    bundle = read_bundle(bundle_path)  # personalise it (numpy only) so that path is covered too
    rng = np.random.default_rng(0)
    lora = {k: (v + rng.normal(0, 0.05, v.shape)).astype(np.float32) for k, v in bundle.lora().items()}
    apply_update(bundle, write_update(tmp_path / "u.safetensors", lora, bundle=bundle, num_examples=1, mean_loss=1.0))
    local = data_root / "train"
    commands = {
        "infer": ["infer", str(data_root / "test" / "red_circle"), "--bundle", str(bundle_path), "--json"],
        "info": ["info", "--bundle", str(bundle_path), "--json"],
        "train": ["train", "--data", str(local), "--bundle", str(bundle_path), "--out", str(tmp_path / "upd")],
        "rollback": ["rollback", "--bundle", str(bundle_path)],
        "rollback-refresh": ["rollback", "--refresh", "--bundle", str(bundle_path)],  # nothing to roll back
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(commands)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=scaled(300))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.rsplit("RESULT ", 1)[1])
    assert result["leaked"] == []
    assert result["codes"] == {"infer": 0, "info": 0, "train": 1, "rollback": 0, "rollback-refresh": 1}, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"path"')]
    assert len(lines) == 8 and all(len(line["top_k"]) == 5 for line in lines)
    info = next(json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"bundle"'))
    assert info["device"]["torch"]["installed"] is False and info["bundle"]["lora"]["source"] == "personalised"
    assert "fedmvp[edge-train]" in proc.stderr  # train says what to install
    assert not (tmp_path / "upd").exists()
