"""edge_client.runtime: provider selection, and the inference path imports no torch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from edge_client import runtime
from edge_client.runtime import ProviderError, available_providers, make_session
from tests.deadlines import scaled

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

REPO_ROOT = Path(__file__).resolve().parents[2]


def _tiny_model(path: Path) -> Path:
    """y = x @ W, x: [N, 3] float32, W = diag(1, 2, 3)."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.diag([1.0, 2.0, 3.0]).astype(np.float32), name="W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        initializer=[w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return _tiny_model(tmp_path_factory.mktemp("onnx") / "tiny.onnx")


def _run(sess) -> np.ndarray:
    x = np.array([[1.0, 1.0, 1.0], [0.5, -1.0, 2.0]], dtype=np.float32)
    (y,) = sess.run(None, {"x": x})
    return y


EXPECTED = np.array([[1.0, 2.0, 3.0], [0.5, -2.0, 6.0]], dtype=np.float32)


def test_available_providers_has_cpu():
    assert "CPUExecutionProvider" in available_providers()


def test_auto_picks_best_available(model_path):
    sess, used = make_session(model_path)
    best = next(p for p in runtime.AUTO_ORDER if p in ort.get_available_providers())
    assert used == best == sess.get_providers()[0]
    np.testing.assert_allclose(_run(sess), EXPECTED)


def test_cpu_by_name_and_options(model_path):
    sess, used = make_session(model_path, provider="CPU", threads=2)
    assert used == "CPUExecutionProvider"
    np.testing.assert_allclose(_run(sess), EXPECTED)
    opts = sess.get_session_options()
    assert opts.intra_op_num_threads == 2
    assert opts.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert opts.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
    assert make_session(model_path, "cpu")[0].get_session_options().intra_op_num_threads == runtime.default_threads()


@pytest.mark.parametrize("name", ["cuda", "tensorrt"])
def test_unavailable_gpu_provider_raises(model_path, name):
    if runtime.PROVIDER_NAMES[name] in ort.get_available_providers():
        pytest.skip(f"{name} is available here")
    with pytest.raises(ProviderError, match=name) as info:
        make_session(model_path, provider=name)
    assert "\n" not in str(info.value)


@pytest.mark.filterwarnings("ignore:Specified provider")
@pytest.mark.parametrize("name", ["cuda", "tensorrt"])
def test_silent_fallback_is_detected(model_path, monkeypatch, name):
    """ORT lists the provider but cannot load it: it falls back to CPU; we must not."""
    if runtime.PROVIDER_NAMES[name] in ort.get_available_providers():
        pytest.skip(f"{name} really is available here")
    fake = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(ort, "get_available_providers", lambda: list(fake))
    with pytest.raises(ProviderError, match="fell back"):
        make_session(model_path, provider=name)
    sess, used = make_session(model_path, provider="auto")  # auto accepts the fallback
    assert used == "CPUExecutionProvider"
    np.testing.assert_allclose(_run(sess), EXPECTED)


def test_bad_arguments(model_path, tmp_path):
    with pytest.raises(ProviderError, match="unknown provider"):
        make_session(model_path, provider="npu")
    with pytest.raises(ValueError):
        make_session(model_path, threads=0)
    with pytest.raises(FileNotFoundError):
        make_session(tmp_path / "missing.onnx")
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a protobuf at all")
    with pytest.raises(Exception) as info:
        make_session(junk, provider="cpu")
    assert not isinstance(info.value, ProviderError)


_BLOCKER = """
import importlib.abc, sys
BLOCKED = {blocked!r}
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked in this test: {{name}}")
        return None
sys.meta_path.insert(0, _Block())
"""


def _python(code: str, blocked: set[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    script = _BLOCKER.format(blocked=sorted(blocked)) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=scaled(120))


@pytest.mark.processes
def test_inference_path_imports_without_torch(model_path, tmp_path):
    img = tmp_path / "x.png"
    from PIL import Image

    Image.new("RGB", (40, 30), (10, 120, 240)).save(img)
    code = f"""
        import sys
        from edge_client.images import load_image
        from edge_client.preprocess import PreprocessSpec, preprocess
        from edge_client.runtime import make_session
        im = load_image({str(img)!r})
        x = preprocess(im, PreprocessSpec(image_size=32))
        assert x.shape == (3, 32, 32), x.shape
        assert preprocess(im, PreprocessSpec.from_manifest({{"image_size": 32}})).shape == (3, 32, 32)
        sess, used = make_session({str(model_path)!r}, "cpu")
        sess.run(None, {{"x": x[:, 0, :3].copy()}})
        bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "torchvision", "open_clip", "fedmvp"))
        assert not bad, bad
        print("OK", used)
    """
    proc = _python(code, {"torch", "torchvision", "open_clip", "fedmvp"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "OK CPUExecutionProvider"


@pytest.mark.processes
def test_missing_onnxruntime_says_what_to_install():
    code = """
        import edge_client.runtime as rt
        try:
            rt.available_providers()
        except ImportError as e:
            print(e)
        else:
            raise SystemExit("no ImportError")
    """
    proc = _python(code, {"onnxruntime"})
    assert proc.returncode == 0, proc.stderr
    assert "fedmvp[cpu]" in proc.stdout and "fedmvp[gpu]" in proc.stdout
