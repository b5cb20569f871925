"""Builds ``examples/cpp``'s ``fedmvp_infer`` (the libtorch consumer, docs/howto/cpp-libtorch.md) once per
source, compiler and torch version, for its test and its benchmark (benchmarks/edge_cpp.py).

Why a content-keyed cache: one build costs about a minute of a small machine's cores (the torch
headers), and a changed source must never be timed or tested through a stale binary.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from fedmvp_formats.files import cache_root

CPP_DIR = Path(__file__).resolve().parents[1] / "examples" / "cpp"
BUILD_SCRIPT = CPP_DIR / "build.sh"


def toolchain_problem(cxx: str = "g++") -> str | None:
    """Why ``fedmvp_infer`` cannot be built here (one line), or None: a compiler, the libjpeg and libpng
    headers and libraries, and the torch wheel's headers and libraries."""
    compiler = shutil.which(os.environ.get("CXX", cxx))
    if compiler is None:
        return f"no C++ compiler ({os.environ.get('CXX', cxx)}) on PATH"
    try:
        import torch
    except ImportError:
        return "torch is not installed (the build uses the libtorch inside its wheel)"
    torch_dir = Path(torch.__file__).parent
    for need in ("include/torch/script.h", "lib/libtorch_cpu.so", "lib/libc10.so"):
        if not (torch_dir / need).exists():
            return f"the torch wheel has no {need} (a wheel without the C++ headers and libraries)"
    for header in ("jpeglib.h", "png.h"):
        if not _compiles(compiler, f"#include <cstdio>\n#include <{header}>\nint main() {{ return 0; }}\n", []):
            return f"no {header} for {compiler} (install the libjpeg and libpng development packages)"
    for lib in ("jpeg", "png"):
        if not _compiles(compiler, "int main() { return 0; }\n", [f"-l{lib}"]):
            return f"{compiler} cannot link -l{lib} (install the lib{lib} development package)"
    return None


def _compiles(compiler: str, source: str, flags: list[str]) -> bool:
    """Whether ``source`` (C++) compiles and links with ``flags``."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text(source)
        proc = subprocess.run([compiler, str(src), "-o", str(Path(tmp) / "probe"), *flags],
                              capture_output=True, text=True, timeout=120)
        return proc.returncode == 0


def source_key() -> str:
    """A digest of the sources, the build script, the compiler and the torch version."""
    import torch

    digest = hashlib.sha256()
    for path in sorted([BUILD_SCRIPT, *(CPP_DIR / "src").iterdir()]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    compiler = shutil.which(os.environ.get("CXX", "g++")) or "g++"
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest.update(f"{compiler}\0{version}\0{torch.__version__}\0{sys.executable}".encode())
    return digest.hexdigest()[:16]


def build_binary(cache: Path | None = None) -> tuple[Path, float]:
    """The built ``fedmvp_infer`` and the seconds its build took (0.0 when the cache held it).

    Built to a temporary name and renamed into place, so a killed build leaves no half binary behind."""
    folder = (cache or cache_root() / "cpp") / source_key()
    binary = folder / "fedmvp_infer"
    if binary.exists():
        return binary, 0.0
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f"fedmvp_infer.partial-{os.getpid()}"
    start = time.perf_counter()
    proc = subprocess.run(["sh", str(BUILD_SCRIPT), str(partial)], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable}, timeout=1200)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"{BUILD_SCRIPT}: build failed: {proc.stderr.strip()[-2000:]}")
    os.replace(partial, binary)
    return binary, seconds
