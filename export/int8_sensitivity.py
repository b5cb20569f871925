"""First-order estimate of what dynamic int8 of each weight MatMul does to each image's top-1 margin.

Why: ranking layers by quantising each one alone and running the ONNX model costs one
quantisation + session + run per layer (the benchmark's figures are in docs/howto/precisions.md). Here one torch
forward + backward per calibration image gives every layer's estimate at once: for a layer
y = x @ M, ONNX Runtime's dynamic int8 computes fq_u8(x) @ fq_s8(M) instead, an output error
dy; with g = d(margin)/dy from one backward of the image's top-1 minus runner-up logit, the
margin moves by about <g, dy>. The quantisers are simulated exactly as ONNX Runtime does them
(``fake_quant_weight``, ``fake_quant_activation``).

Every torch matmul with a constant (non-LoRA) right operand is recorded: ``F.linear`` (also
called by nn.MultiheadAttention for its packed in-projection and its out-projection, which
never run their modules' ``forward``) and ``@`` / ``torch.matmul``. They are matched with the
ONNX MatMul nodes by the bytes of the weight, not by names: after the transposes are folded
the ONNX weight initializer equals the torch operand M (W.T for a Linear).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from torch.overrides import TorchFunctionMode

from export.edge_module import EdgeClassifier, no_mha_fastpath

WEIGHT_QMAX = 64  # ONNX Runtime's s8 reduce_range: [-64, 64], symmetric, scale = max|w| / 64
RUN_BATCH = 32  # export.parity.onnx_outputs' batch
FIRST_ORDER_IMAGES = 32  # one forward + backward each (about a second per image for ViT-B-16 on 2 cores)
MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)


def fake_quant_weight(m: torch.Tensor) -> torch.Tensor:
    """``m`` [K, N] (y = x @ m) through s8 per output channel (column), 7-bit symmetric, and back."""
    scale = m.abs().amax(dim=0, keepdim=True) / WEIGHT_QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.clamp(torch.round(m / scale), -WEIGHT_QMAX, WEIGHT_QMAX) * scale


def fake_quant_activation(x: torch.Tensor, low: float | None = None, high: float | None = None) -> torch.Tensor:
    """``x`` through DynamicQuantizeLinear (per tensor u8, range widened to include 0) and back.

    ``low`` / ``high``: the tensor's range when it is computed on a whole batch (ONNX Runtime
    quantises the batch's activations together) while ``x`` is one image of it."""
    low = min(float(x.min()) if low is None else low, 0.0)
    high = max(float(x.max()) if high is None else high, 0.0)
    scale = (high - low) / 255.0
    if scale == 0.0:
        return x
    zero = float(np.clip(np.round(-low / scale), 0, 255))
    return (torch.clamp(torch.round(x / scale) + zero, 0, 255) - zero) * scale


def weight_key(m: np.ndarray) -> str:
    """Identity of a weight by shape and bytes (how torch operands and ONNX initializers are matched)."""
    m = np.ascontiguousarray(m, dtype=np.float32)
    return f"{m.shape}:{hashlib.sha1(m.tobytes()).hexdigest()}"


class _Recorder(TorchFunctionMode):
    """Records y = x @ M for every M that is a constant tensor of the model, and hooks y's gradient."""

    def __init__(self, constants: set[int]):
        super().__init__()
        self.constants = constants
        self.keys: dict[str, str] = {}  # id of the operand's storage + view -> weight key
        self.quantized: dict[str, torch.Tensor] = {}  # weight key -> fake-quantised weight
        self.shifts: dict[str, float] = {}  # weight key -> <g, dy> of the current image
        self.ranges: dict[str, tuple[float, float]] = {}  # weight key -> its input's range on the batch
        self.collect = False  # True: record the input ranges (no-grad batch pass), no shifts
        self.linear = F.linear
        self.busy = False  # recording's own matmuls are not layers

    def _is_constant(self, m: object) -> bool:
        return isinstance(m, torch.Tensor) and m.dim() == 2 and m.untyped_storage().data_ptr() in self.constants

    def key(self, m: torch.Tensor) -> str:
        ident = f"{m.untyped_storage().data_ptr()}:{m.stride()}:{tuple(m.shape)}"
        if ident not in self.keys:
            self.keys[ident] = weight_key(m.detach().cpu().numpy())
        return self.keys[ident]

    def record(self, x: torch.Tensor, m: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """dy = fq(x) @ fq(m) - x @ m, with x @ m = y - bias taken from the forward (one matmul less)."""
        if self.busy or not (self.collect or y.requires_grad):
            return
        key = self.key(m)
        if self.collect:
            low, high = self.ranges.get(key, (0.0, 0.0))
            self.ranges[key] = (min(low, float(x.min())), max(high, float(x.max())))
            return
        self.busy = True
        try:
            with torch.no_grad():
                if key not in self.quantized:
                    self.quantized[key] = fake_quant_weight(m.detach())
                exact = y.detach() if bias is None else y.detach() - bias.detach()
                delta = fake_quant_activation(x.detach(), *self.ranges.get(key, (None, None))) @ self.quantized[key]
                delta -= exact
        finally:
            self.busy = False

        def hook(grad: torch.Tensor) -> None:
            self.shifts[key] = self.shifts.get(key, 0.0) + float((grad * delta).sum())
        y.register_hook(hook)

    def patched_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.linear(x, weight, bias)
        if self._is_constant(weight):
            self.record(x, weight.t(), y, bias)
        return y

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in MATMULS and len(args) == 2 and self._is_constant(args[1]):
            self.record(args[0], args[1], out)
        return out


@contextlib.contextmanager
def _recording(edge: EdgeClassifier) -> Iterator[_Recorder]:
    lora = {id(t) for t in edge.lora_tensors().values()}
    constants = {t.untyped_storage().data_ptr() for t in edge.frozen_tensors().values() if id(t) not in lora}
    recorder = _Recorder(constants)
    F.linear = recorder.patched_linear  # nn.Linear and MultiheadAttention look it up per call (process-wide
    # while recording: the export runs one thing at a time)
    try:
        with recorder, no_mha_fastpath():
            yield recorder
    finally:
        F.linear = recorder.linear


def _margin(logits: torch.Tensor) -> torch.Tensor:
    top = torch.topk(logits, 2, dim=-1).indices[0]
    return logits[0, top[0]] - logits[0, top[1]]


def first_order_shifts(edge: EdgeClassifier, images: torch.Tensor, batch: int = RUN_BATCH) -> dict[str, np.ndarray]:
    """Weight key -> [N] estimated change of each image's top-1 margin when that layer alone is int8.

    Activations are quantised per tensor over the batch ONNX Runtime runs (``batch`` images, as
    the verifying runs and the parity check do): one no-grad pass per batch records each layer's
    input range, then each image runs forward + backward alone with those ranges."""
    edge.eval()
    trainable = [p for p in edge.parameters() if p.requires_grad]  # LoRA: no weight gradients needed
    for p in trainable:
        p.requires_grad_(False)
    rows: list[dict[str, float]] = []
    try:
        with _recording(edge) as recorder:
            for i, image in enumerate(images):
                if i % batch == 0:
                    recorder.ranges, recorder.collect = {}, True
                    with torch.no_grad():
                        edge(images[i:i + batch])
                    recorder.collect = False
                recorder.shifts = {}
                x = image[None].clone().requires_grad_(True)  # the graph needs grad from the start
                _margin(edge(x)[0]).backward()
                rows.append(recorder.shifts)
    finally:
        for p in trainable:
            p.requires_grad_(True)
    keys = sorted({k for row in rows for k in row})
    return {k: np.array([row.get(k, 0.0) for row in rows]) for k in keys}


def onnx_weight_keys(proto: onnx.ModelProto, layers: list[str]) -> dict[str, str]:
    """ONNX MatMul layer name -> key of its constant weight (input 1)."""
    inits = {init.name: init for init in proto.graph.initializer}
    nodes = {node.name: node for node in proto.graph.node}
    return {name: weight_key(numpy_helper.to_array(inits[nodes[name].input[1]])) for name in layers}


def layer_shifts(edge: EdgeClassifier, images: torch.Tensor, proto: onnx.ModelProto,
                 layers: list[str]) -> dict[str, np.ndarray]:
    """ONNX layer name -> [N] first-order margin shifts; layers with no torch twin are left out."""
    shifts = first_order_shifts(edge, images)
    keys = onnx_weight_keys(proto, layers)
    return {name: shifts[key] for name, key in keys.items() if key in shifts}
