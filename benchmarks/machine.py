"""The machine a benchmark ran on, and its measured fp32 GEMM peak (what "close to the limit" means).

CPU model, the SIMD flags that decide int8 and fp16 speed (AVX2, AVX-512, VNNI, AMX), cores and
threads, memory, GPU, and the versions of every runtime measured, so a results.json can be compared
with another machine's."""

from __future__ import annotations

import os
import platform
import sys
import time
from importlib import metadata

FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16",
         "amx_tile", "amx_int8", "amx_bf16", "asimd", "asimddp", "sve")
PACKAGES = ("numpy", "torch", "onnxruntime", "onnxruntime-gpu", "onnx", "onnxscript", "open_clip_torch",
            "flwr", "ray", "peft")


def cpu_info() -> dict:
    """Model name and the SIMD flags of interest, from /proc/cpuinfo (Linux) or platform."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model") and model in ("", platform.machine(), platform.processor()):
                    model = value.strip()
                elif key in ("flags", "Features"):
                    flags |= set(value.split())
    except OSError:
        pass
    return {"model": model, "flags": [f for f in FLAGS if f in flags], "logical_cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}


def memory_gb() -> float | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        return None
    return None


def versions() -> dict:
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def gpu_info() -> dict | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "memory_gb": round(props.total_memory / (1 << 30), 1),
            "capability": f"{props.major}.{props.minor}"}


def describe(threads: int) -> dict:
    return {"cpu": cpu_info(), "memory_gb": memory_gb(), "threads": threads, "gpu": gpu_info(),
            "versions": versions(), "when": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def line(info: dict) -> str:
    """One human line: CPU, flags, threads, versions."""
    cpu, v = info["cpu"], info["versions"]
    gpu = f"; GPU {info['gpu']['name']}" if info.get("gpu") else ""
    runtimes = ", ".join(f"{k} {v[k]}" for k in ("torch", "onnxruntime", "onnxruntime-gpu", "flwr") if k in v)
    return (f"{cpu['model']} ({cpu['usable_cores']} usable cores, {info['threads']} threads; "
            f"{' '.join(cpu['flags']) or 'no SIMD flags read'}), {info['memory_gb']} GB{gpu}; "
            f"Python {v['python']}, {runtimes}")


# ---- fp32 GEMM peak ---------------------------------------------------------------------------------
# Shapes of the ViT-B-16 MLP and attention projections at batch 8 (8 x 201 tokens), and a square one.
GEMM_SHAPES = ((1608, 768, 3072), (1608, 3072, 768), (1608, 768, 2304), (2048, 2048, 2048))


def torch_gemm_gflops(m: int, k: int, n: int, repeats: int) -> float:
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    from benchmarks.common import median_seconds

    seconds = median_seconds(lambda: torch.mm(a, b), repeats, warmup=2)
    return 2 * m * k * n / seconds / 1e9


def ort_gemm_gflops(m: int, k: int, n: int, repeats: int, threads: int) -> float:
    """ONNX Runtime's own MatMul kernel (MLAS) on one constant-weight MatMul."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from benchmarks.common import median_seconds

    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((k, n)).astype("float32"), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "gemm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])], [weight])
    # IR 8: an ONNX Runtime a release behind the onnx package refuses its newest IR version
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((m, k)).astype("float32")
    seconds = median_seconds(lambda: session.run(None, {"x": x}), repeats, warmup=2)
    del onnx
    return 2 * m * k * n / seconds / 1e9


def gemm_peak(threads: int, quick: bool = False) -> dict:
    """Best fp32 GFLOP/s of torch (oneDNN/MKL) and ONNX Runtime (MLAS) over the shapes above."""
    shapes = GEMM_SHAPES[:1] if quick else GEMM_SHAPES
    repeats = 3 if quick else 7
    rows = []
    for m, k, n in shapes:
        rows.append({"shape": f"{m}x{k}x{n}", "torch_gflops": round(torch_gemm_gflops(m, k, n, repeats), 1),
                     "ort_gflops": round(ort_gemm_gflops(m, k, n, repeats, threads), 1)})
    peak = max(max(r["torch_gflops"], r["ort_gflops"]) for r in rows)
    return {"gflops": peak, "shapes": rows}
