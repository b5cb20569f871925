"""OpenVINO as the device's second runtime: the bundle's model.onnx compiled by ``openvino.Core``.

Why: on CPUs with BF16 (AVX-512 BF16, AMX) OpenVINO's bf16 precision hint runs the same ONNX model
about twice as fast as ONNX Runtime fp32 (docs/benchmarks.md, edge runtimes); fp32 is near its ceiling in both.
OpenVINO reads the bundle's LoRA initializers as constants, so they are turned back into graph
Parameters of the same names before compiling: the LoRA the device runs (the bundle's, a
personalised one, a round's global one) is fed per run, as ONNX Runtime feeds its overridable
initializers (``edge_client/infer.py``, ``Predictor.use_lora``), and one compiled model serves every
LoRA. openvino is imported lazily (extra ``fedmvp[openvino]``); ``FEDMVP_DISABLED_RUNTIMES`` makes
it unavailable on purpose. `OpenVinoRuntime` is its entry in the table of runtimes (``edge_client/engines.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from edge_client.bundle import Bundle
from edge_client.engine_types import Candidate
from edge_client.runtime import default_threads

# The precision hint each precision compiles with. A reduced-precision bundle (fp16, int8) compiles with
# f32: OpenVINO must not lower what the exporter kept in fp32 further.
HINTS = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}
# OPTIMIZATION_CAPABILITIES of the CPU plugin that offer each reduced precision.
CAPABILITIES = {"bf16": "BF16", "fp16": "FP16"}
DEVICE = "CPU"


def load_openvino() -> ModuleType:
    """Import openvino; ImportError naming the extra when it is missing."""
    try:
        import openvino
    except ImportError as err:
        raise ImportError(f"openvino is not installed ({err}); install fedmvp[openvino]") from err
    return openvino


def version() -> str:
    """openvino's version string."""
    return str(load_openvino().get_version())


def cpu_precisions(bundle_precision: str) -> list[str]:
    """What OpenVINO's CPU plugin offers for a bundle of ``bundle_precision``: an fp32 bundle in fp32 and
    in each reduced precision the CPU lists; a reduced-precision bundle as exported."""
    if bundle_precision != "fp32":
        return [bundle_precision]
    capabilities = set(load_openvino().Core().get_property(DEVICE, "OPTIMIZATION_CAPABILITIES"))
    return ["fp32", *(p for p, cap in CAPABILITIES.items() if cap in capabilities)]


class OpenVinoRuntime:
    """OpenVINO in the table of runtimes: the CPU plugin, an fp32 bundle also at the reduced precisions
    the CPU lists (``cpu_precisions``); ONNX Runtime's provider does not apply."""

    label = "fedmvp[openvino]"
    version_key = "openvino"

    def load(self) -> None:
        load_openvino()

    def version(self) -> str:
        return version()

    def offered(self, bundle: Bundle) -> list[str]:
        return cpu_precisions(bundle.precision)

    def open(self, bundle: Bundle, candidate: Candidate, provider: str, threads: int | None,
             initializers: Mapping[str, np.ndarray] | None) -> "OpenVinoEngine":
        return OpenVinoEngine(bundle.file("onnx"), candidate.precision, bundle.precision, set(bundle.lora_shapes),
                              threads, initializers)


class OpenVinoEngine:
    """The bundle's ONNX model compiled for the CPU at one precision, its LoRA fed per run."""

    runtime = "openvino"

    def __init__(self, model_path: Path, precision: str, bundle_precision: str, lora_names: set[str],
                 threads: int | None = None, initializers: Mapping[str, np.ndarray] | None = None) -> None:
        ov = load_openvino()
        core = ov.Core()
        model = core.read_model(str(model_path))
        stored = _lora_as_parameters(model, lora_names)
        hint = HINTS[precision] if bundle_precision == "fp32" else "f32"
        n = default_threads() if threads is None else threads
        self._compiled = core.compile_model(model, DEVICE, {"INFERENCE_PRECISION_HINT": hint,
                                                            "INFERENCE_NUM_THREADS": int(n),
                                                            "PERFORMANCE_HINT": "LATENCY"})
        self._request = self._compiled.create_infer_request()
        self.precision = precision
        self.device = f"OpenVINO {DEVICE}"
        inputs = {port.get_any_name(): port for port in self._compiled.inputs}
        self.lora_dtypes = {name: _numpy_type(ov, port) for name, port in inputs.items() if name in lora_names}
        self.inputs = {name: _numpy_type(ov, port) for name, port in inputs.items() if name not in lora_names}
        self.outputs = [port.get_any_name() for port in self._compiled.outputs]
        self.output_widths = {port.get_any_name(): _last_dim(port) for port in self._compiled.outputs}
        self._lora = {name: np.ascontiguousarray(value, dtype=self.lora_dtypes[name])
                      for name, value in {**stored, **(initializers or {})}.items()}

    def run(self, feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Every output, in ``self.outputs`` order; a LoRA tensor absent from ``feed`` is the one given at
        creation (the bundle's by default)."""
        results = self._request.infer({**self._lora, **feed})
        return [np.array(results[port]) for port in self._compiled.outputs]


def _lora_as_parameters(model: Any, lora_names: set[str]) -> dict[str, np.ndarray]:
    """Replace the LoRA constants OpenVINO read from the initializers by Parameters of the same names;
    the values they held (the bundle's LoRA)."""
    from openvino import opset13

    found, stored = [], {}
    for op in model.get_ops():
        name = op.get_friendly_name()
        if op.get_type_name() != "Constant" or name not in lora_names:
            continue
        stored[name] = np.array(op.get_data())
        parameter = opset13.parameter(op.get_output_partial_shape(0), op.get_output_element_type(0), name=name)
        parameter.output(0).set_names({name})
        for target in list(op.output(0).get_target_inputs()):
            target.replace_source_output(parameter.output(0))
        found.append(parameter)
    missing = sorted(lora_names - {p.get_friendly_name() for p in found})
    if missing:
        raise ValueError(f"OpenVINO folded the LoRA tensor {missing[0]} into the graph; it cannot be fed")
    model.add_parameters(found)
    model.validate_nodes_and_infer_types()
    return stored


def _numpy_type(ov: ModuleType, port: Any) -> type:
    return np.float16 if port.get_element_type() == ov.Type.f16 else np.float32


def _last_dim(port: Any) -> int | None:
    shape = port.get_partial_shape()
    if shape.rank.is_dynamic or len(shape) == 0 or shape[len(shape) - 1].is_dynamic:
        return None
    return int(shape[len(shape) - 1].get_length())
