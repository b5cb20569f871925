"""Each package exports its public API in ``__all__`` (docs/architecture.md), and that list imports.

The names are resolved lazily (PEP 562), so the tests also check that importing a package stays
cheap and that the device's names import where torch cannot be.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tests.deadlines import scaled

REPO = Path(__file__).resolve().parents[1]
PUBLIC = {
    "fedmvp": {"FedMVP", "FedMVPConfig", "PromptFormer", "PromptFormerConfig", "load_clip", "LoadedClip",
               "ClipLoadError", "RunDir", "RunError", "Checkpoint", "load_preset", "Preset", "prepare_run"},
    "export": {"export_bundle", "write_bundle", "BundleResult", "ParityError", "ExportError", "ExportOptions",
               "BundleOptions", "BundleInputs"},
    "edge_client": {"Bundle", "BundleError", "read_bundle", "infer_paths", "Predictor", "Prediction",
                    "InferResult", "apply_update", "rollback", "ActiveLora", "read_update", "write_update",
                    "Update", "UpdateError", "train_local", "TrainResult", "TrainOptions", "TrainingError",
                    "TrainInputError"},
}
HEAVY = ("torch", "onnxruntime", "open_clip", "onnx", "peft")  # what a bare `import <package>` must not load

BLOCKED = textwrap.dedent("""
    import importlib.abc, json, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCK:
                raise ImportError(f"{name} is blocked in this test")
            return None

    BLOCK = set(json.loads(sys.argv[1]))
    sys.meta_path.insert(0, Block())
    exec(sys.argv[2])
    print("RESULT " + json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
""")


def run_blocked(block: list[str], code: str) -> list[str]:
    """Run ``code`` in a fresh interpreter where the ``block`` packages cannot be imported; the top-level
    modules it loaded."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", BLOCKED, json.dumps(block), code], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=scaled(120))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.rsplit("RESULT ", 1)[1])


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_all_is_the_public_api(package):
    module = importlib.import_module(package)
    assert set(module.__all__) == PUBLIC[package]
    assert len(module.__all__) == len(set(module.__all__))
    assert [name for name in module.__all__ if name.startswith("_")] == []


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_every_name_in_all_imports(package):
    module = importlib.import_module(package)
    namespace: dict = {}
    exec(f"from {package} import {', '.join(module.__all__)}", namespace)
    for name in module.__all__:
        value = namespace[name]
        assert value is getattr(module, name)
        assert getattr(value, "__module__", "").startswith(package + "."), name  # defined in the package
        assert name in dir(module)


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_unknown_names_are_attribute_errors(package):
    module = importlib.import_module(package)
    with pytest.raises(AttributeError, match="no_such_name"):
        module.no_such_name  # noqa: B018


@pytest.mark.processes
def test_importing_the_packages_loads_nothing_heavy():
    loaded = run_blocked([], "import fedmvp, export, edge_client; print(fedmvp.__version__)")
    assert [name for name in HEAVY if name in loaded] == []


@pytest.mark.processes
def test_the_device_api_imports_without_torch():
    code = ("try:\n    import torch\nexcept ImportError:\n    pass\nelse:\n    raise SystemExit('not blocked')\n"
            "import edge_client\n"
            "from edge_client import *\n"
            "missing = [n for n in edge_client.__all__ if n not in globals()]\n"
            "assert not missing, missing\n")
    loaded = run_blocked(["torch", "fedmvp", "export", "open_clip"], code)
    assert "edge_client" in loaded
    assert [name for name in ("torch", "fedmvp", "export", "open_clip") if name in loaded] == []
