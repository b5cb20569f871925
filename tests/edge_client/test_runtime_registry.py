"""An edge runtime registered from outside the package runs `edge-client infer`, named and under auto.

The recipe of docs/architecture.md ("How to add ...", "An edge runtime") followed by a test: a runtime is
a factory (load, version, offered precisions, open) and one ``register_runtime`` call; ``--runtime``
accepts its name, ``auto`` weighs it with the others, and ``info`` reports it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping

import numpy as np
import pytest
from click.testing import CliRunner

from edge_client.engines import (OrtEngine, register_runtime, runtime_names, unavailable,
                                 unregister_runtime)
from fedmvp_apps.edge_bundle import DISABLED_ENV
from fedmvp_apps.edge_cli import main


class CountingEngine:
    """ONNX Runtime's engine, its runs counted (and slowed, or its logits rolled, where asked)."""

    def __init__(self, inner: OrtEngine, name: str, calls: list[str], delay: float, roll: bool) -> None:
        self.inner, self.runtime, self.calls, self.delay, self.roll = inner, name, calls, delay, roll
        self.precision, self.device = inner.precision, f"{name} (ONNX Runtime {inner.device})"
        self.inputs, self.lora_dtypes = inner.inputs, inner.lora_dtypes
        self.outputs, self.output_widths = inner.outputs, inner.output_widths

    def run(self, feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        self.calls.append(self.runtime)
        time.sleep(self.delay)
        out = self.inner.run(feed)
        return [np.roll(o, 1, axis=-1) for o in out] if self.roll else out


class CountingRuntime:
    """A runtime factory as outside code writes one: ONNX Runtime underneath, every run counted."""

    label = "counting ONNX Runtime"

    def __init__(self, name: str, delay: float = 0.0, roll: bool = False) -> None:
        self.name, self.version_key, self.delay, self.roll = name, name, delay, roll
        self.calls: list[str] = []

    def load(self) -> None:
        import onnxruntime  # noqa: F401 - the ImportError is the one line `unavailable` reports

    def version(self) -> str:
        return "0.1-test"

    def offered(self, bundle) -> list[str]:
        return [bundle.precision]

    def open(self, bundle, candidate, provider, threads, initializers):
        inner = OrtEngine(bundle.file("onnx"), candidate.precision, set(bundle.lora_shapes), provider, threads,
                          initializers)
        return CountingEngine(inner, self.name, self.calls, self.delay, self.roll)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Each test its own verdict cache ($FEDMVP_CACHE), never the user's."""
    monkeypatch.setenv("FEDMVP_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def counting():
    runtimes = {"counting": CountingRuntime("counting"), "slowcount": CountingRuntime("slowcount", delay=0.02),
                "rolled": CountingRuntime("rolled", roll=True)}
    for name, runtime in runtimes.items():
        register_runtime(name, runtime)
    yield runtimes
    for name in runtimes:
        unregister_runtime(name)


def _infer(edge_bundle, data_root, *args: str):
    folder = data_root / "test" / "red_circle"
    out = CliRunner().invoke(main, ["infer", str(folder), "--bundle", str(edge_bundle), "--json", "--bundle-lora",
                                    *args])
    assert out.exit_code == 0, out.output
    return out, [json.loads(line) for line in out.stdout.splitlines()]


def test_a_registered_runtime_is_named_on_the_command_line(counting, edge_bundle, data_root):
    assert runtime_names()[:2] == ("ort", "openvino") and "counting" in runtime_names()
    ort, ort_lines = _infer(edge_bundle, data_root, "--runtime", "ort")
    out, lines = _infer(edge_bundle, data_root, "--runtime", "counting")
    assert "runtime: counting fp32" in out.stderr
    assert {line["runtime"] for line in lines} == {"counting"} and len(lines) == len(ort_lines) > 0
    assert [line["top_k"] for line in lines] == [line["top_k"] for line in ort_lines]  # the same model, run
    assert counting["counting"].calls and not counting["slowcount"].calls
    help_text = CliRunner().invoke(main, ["infer", "--help"]).output
    assert "[auto|ort|openvino|torchscript|executorch|counting|slowcount|rolled]" in help_text.replace("\n", "").replace(" ", "")


def test_auto_weighs_every_registered_runtime(counting, edge_bundle, data_root, monkeypatch):
    monkeypatch.setenv(DISABLED_ENV, "openvino")
    out, lines = _infer(edge_bundle, data_root, "--runtime", "auto")
    assert all(counting[name].calls for name in counting)  # each was run on the check images
    picked = {line["runtime"] for line in lines}
    assert picked <= {"ort", "counting"} and len(picked) == 1  # never the slow one, never the wrong one
    assert "picked by auto" in out.stderr and "rolled fp32 failed verification, not used" in out.stderr
    info = CliRunner().invoke(main, ["info", "--bundle", str(edge_bundle), "--runtime", "auto", "--json"])
    report = json.loads(info.stdout)
    assert set(report["runtime"]["verdicts"]) == {"ort:fp32", "counting:fp32", "slowcount:fp32", "rolled:fp32"}
    assert report["runtime"]["cached"] and not report["runtime"]["verdicts"]["rolled:fp32"]["passed"]
    runtimes = report["device"]["runtimes"]
    assert runtimes["counting"] == {"available": True, "version": "0.1-test"}
    assert runtimes["openvino"]["available"] is False and set(report["runtime"]["offered"]) >= {"ort", "counting"}


def test_auto_takes_a_registered_runtime_that_is_the_only_one_left(counting, edge_bundle, data_root, monkeypatch):
    monkeypatch.setenv(DISABLED_ENV, "ort,openvino,slowcount,rolled")
    out, lines = _infer(edge_bundle, data_root, "--runtime", "auto")
    assert {line["runtime"] for line in lines} == {"counting"}
    assert "runtime: counting fp32 (the only one offered here: ort is disabled" in out.stderr
    assert unavailable("counting") is None


def test_a_registered_runtime_unregistered_is_no_choice(counting, edge_bundle, data_root):
    unregister_runtime("counting")
    image = str(sorted((data_root / "test" / "red_circle").glob("*.png"))[0])
    out = CliRunner().invoke(main, ["infer", image, "--bundle", str(edge_bundle), "--runtime", "counting"])
    assert out.exit_code == 2 and "'counting' is not one of" in out.output
    with pytest.raises(ValueError, match="registered already"):
        register_runtime("ort", CountingRuntime("ort"))
    with pytest.raises(ValueError, match="other than auto"):
        register_runtime("auto", CountingRuntime("auto"))
