"""The bundle's training program (``train.pt2``), run node by node with optional activation checkpointing.

Why not simply ``module(...)``: torch.export records float32/CPU type assertions that would
refuse CUDA and autocast, and a constrained GPU needs the graph cut into checkpointed pieces.
Needs torch; imported only by ``edge_client.train``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edge_client.bundle import Bundle, BundleError, verify_program_archive

_PROGRAMS: dict[str, Any] = {}


class ProgramLoadError(BundleError):
    """train.pt2 does not load with this torch (``reason``: torch's words); the TorchScript training module
    may stand in for it (``load_runner``)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


def load_runner(bundle: Bundle, program: str = "auto") -> tuple[Any, str, str | None]:
    """(runner, the program's name, a one-line note or None): what `edge-client train` trains through.

    ``program``: ``pt2`` the training program (`load_program`); ``torchscript`` the TorchScript training
    module (``edge_client.torchscript_training``); ``auto`` train.pt2, and where this torch cannot load it
    the TorchScript module if the bundle carries one (the note says so; docs/howto/torchscript.md)."""
    from edge_client.torchscript_training import has_module, load_script_runner

    if program == "torchscript":
        return load_script_runner(bundle), "torchscript", None
    try:
        return load_program(bundle), "pt2", None
    except ProgramLoadError as err:
        if program != "auto" or not has_module(bundle):
            raise
        import torch

        runner = load_script_runner(bundle)
        return runner, "torchscript", (f"train.pt2 does not load with torch {torch.__version__} ({err.reason}); "
                                       f"training through train.torchscript.pt")


def load_program(bundle: Bundle) -> GraphRunner:
    """The bundle's training program as a `GraphRunner` (cached per file hash in this process).

    The program holds no weights (each call passes weights.safetensors' tensors), so a refresh that
    rewrites only the weights keeps it valid; an edge node's warm executor
    (fedmvp_apps/deploy/warm_executor.py) therefore loads it once, not every round."""
    import torch

    path = bundle.file("training")
    key = bundle.manifest["files"][path.name]["sha256"]  # read_bundle verified it
    if key not in _PROGRAMS:
        verify_program_archive(path)
        try:
            module = torch.export.load(str(path)).module()
        except Exception as err:  # noqa: BLE001 - torch raises many kinds for a bad or too-new archive
            reason = ' '.join(str(err).split())[:300]
            raise ProgramLoadError(f"{path}: cannot load the training program with torch {torch.__version__} "
                                   f"({reason})", reason) from None
        _PROGRAMS.clear()  # one program per process: a refresh that replaced the file drops the old one
        _PROGRAMS[key] = GraphRunner(module)
    return _PROGRAMS[key]


class GraphRunner:
    """Runs the exported program's FX graph node by node, optionally in checkpointed segments.

    - the ``aten._assert_tensor_metadata`` nodes torch.export records (dtype float32 and the
      export device, CPU) are skipped, so the program runs on CUDA and under autocast;
    - with ``segments > 1`` the graph is cut before LayerNorm nodes (residual-stream
      boundaries) into that many pieces, each run under non-reentrant activation
      checkpointing: backward recomputes one piece at a time instead of keeping every
      activation of the ViT alive. Results and gradients equal the plain run.
    Values are dropped as soon as their last user has run.
    """

    program = "pt2"

    def __init__(self, module: Any) -> None:
        import torch

        self.module = module
        self.in_spec = getattr(module, "_in_spec", None)
        graph = module.graph
        skip = {torch.ops.aten._assert_tensor_metadata.default}
        self.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.output = next(n for n in graph.nodes if n.op == "output")
        self.body = [n for n in graph.nodes if n.op not in ("placeholder", "output") and n.target not in skip]
        self.cut_candidates = [i for i, n in enumerate(self.body) if n.target == torch.ops.aten.layer_norm.default]
        self._plans: dict[int, list[_Segment]] = {}

    # ---- inputs -----------------------------------------------------------------------------------
    def flatten(self, pixel_values: Any, view: Any, lora: dict[str, Any], weights: dict[str, Any]) -> list[Any]:
        """The program's flat inputs, in the order torch.export recorded (refuses tensors that do not fit)."""
        from torch.utils._pytree import tree_flatten

        flat, spec = tree_flatten(((pixel_values, view, dict(sorted(lora.items())), dict(sorted(weights.items()))),
                                   {}))
        if self.in_spec is not None and spec != self.in_spec:
            raise BundleError("the training program's inputs do not match the bundle's LoRA/weights tensors")
        if len(flat) != len(self.placeholders):
            raise BundleError(f"the training program takes {len(self.placeholders)} tensors, got {len(flat)}")
        return flat

    # ---- segments ---------------------------------------------------------------------------------
    def max_segments(self) -> int:
        """Most pieces the graph can be cut into (one per LayerNorm, plus one)."""
        return len(self.cut_candidates) + 1

    def plan(self, segments: int) -> list[_Segment]:
        """The graph cut into ``segments`` pieces at evenly spaced LayerNorms (cached per count)."""
        segments = max(1, min(int(segments), self.max_segments()))
        if segments not in self._plans:
            cuts = [0]
            if segments > 1:
                picks = np.linspace(0, len(self.cut_candidates), segments, endpoint=False)[1:]
                cuts += sorted({self.cut_candidates[int(p)] for p in picks} - {0})
            cuts.append(len(self.body))
            self._plans[segments] = _build_segments(self.body, cuts, self.placeholders, self.output, self.module)
        return self._plans[segments]

    def __call__(self, pixel_values: Any, view: Any, lora: dict[str, Any], weights: dict[str, Any],
                 segments: int = 1) -> tuple[Any, Any, Any]:
        """(prompted_features, logits, frozen_features), like ``module(pixel_values, view, lora, weights)``."""
        import torch
        from torch.utils.checkpoint import checkpoint

        env: dict[Any, Any] = dict(zip(self.placeholders, self.flatten(pixel_values, view, lora, weights)))
        plan = self.plan(segments)
        for seg in plan:
            args = [env[n] for n in seg.inputs]
            needs_grad = torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args)
            if len(plan) > 1 and needs_grad:
                outs = checkpoint(seg.run, *args, use_reentrant=False)
            else:
                outs = seg.run(*args)
            env.update(zip(seg.outputs, outs))
            for n in seg.release:
                env.pop(n, None)
        result = torch.fx.node.map_arg(self.output.args[0], lambda n: env[n])
        return tuple(result)


class _Segment:
    """A contiguous run of graph nodes: inputs from outside, outputs needed later."""

    def __init__(self, nodes: list[Any], inputs: list[Any], outputs: list[Any], release: list[Any],
                 module: Any) -> None:
        self.nodes, self.inputs, self.outputs, self.release, self.module = nodes, inputs, outputs, release, module
        last: dict[Any, int] = {}
        for i, n in enumerate(nodes):
            for arg in n.all_input_nodes:
                last[arg] = i
        keep = set(outputs)
        self.drop_after: list[list[Any]] = [[] for _ in nodes]
        for value, i in last.items():
            if value not in keep:
                self.drop_after[i].append(value)

    def run(self, *args: Any) -> tuple[Any, ...]:
        """Run this piece's nodes, freeing each value after its last use."""
        import torch

        local: dict[Any, Any] = dict(zip(self.inputs, args))
        load = local.__getitem__
        for i, node in enumerate(self.nodes):
            a = torch.fx.node.map_arg(node.args, load)
            kw = torch.fx.node.map_arg(node.kwargs, load)
            if node.op == "call_function":
                local[node] = node.target(*a, **kw)
            elif node.op == "call_method":
                local[node] = getattr(a[0], node.target)(*a[1:], **kw)
            elif node.op == "call_module":
                local[node] = self.module.get_submodule(node.target)(*a, **kw)
            elif node.op == "get_attr":
                obj = self.module
                for part in str(node.target).split("."):
                    obj = getattr(obj, part)
                local[node] = obj
            else:  # pragma: no cover - torch.export graphs hold no other kinds
                raise BundleError(f"the training program holds an unsupported graph node {node.op} {node.target}")
            for value in self.drop_after[i]:
                local.pop(value, None)
        return tuple(local[n] for n in self.outputs)


def _build_segments(body: list[Any], cuts: list[int], placeholders: list[Any], output: Any,
                    module: Any) -> list[_Segment]:
    last_segment: dict[Any, int] = {}  # the last segment that reads a value (the output counts as one more)
    for s in range(len(cuts) - 1):
        for n in body[cuts[s]:cuts[s + 1]]:
            for arg in n.all_input_nodes:
                last_segment[arg] = s
    for arg in output.all_input_nodes:
        last_segment[arg] = len(cuts) - 1
    segments = []
    for s in range(len(cuts) - 1):
        nodes = body[cuts[s]:cuts[s + 1]]
        inside = set(nodes)
        inputs: list[Any] = []
        for n in nodes:
            for arg in n.all_input_nodes:
                if arg not in inside and arg not in inputs:
                    inputs.append(arg)
        outputs = [n for n in nodes if last_segment.get(n, -1) > s]
        release = [v for v, last in last_segment.items() if last == s]  # nothing later reads these
        segments.append(_Segment(nodes, inputs, outputs, release, module))
    return segments
