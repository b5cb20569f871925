"""What every benchmark section shares: its options, its result record, timing and memory helpers.

A section is a module with ``run(options: Options) -> Section``. The suite (benchmarks/suite.py)
runs the sections asked for, writes ``results.json``, a markdown table and plots from their
``Section`` records, and prints which goals are met. Goals are reported, never asserted: the
machine is shared and noisy, so timings are medians of several runs and ratios are measured in
one process, interleaved (``interleaved_medians``).
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@dataclass
class Options:
    """Settings every section reads (the suite's command-line flags)."""

    quick: bool = False  # smoke test: tiny model, fewest repeats and batches, seconds not minutes
    device: str = "cpu"  # cpu | cuda
    model: str | None = None  # CLIP architecture for the sections that take one (default per section)
    threads: int | None = None  # intra-op threads for torch and ONNX Runtime (default: all cores)
    repeats: int | None = None  # timing repeats (default: 5, 2 with --quick)
    out: Path | None = None  # where the suite writes; sections may keep files there
    run: Path | None = None  # a trained run (e.g. `fedmvp demo`'s) for the figures that need real weights

    def reps(self) -> int:
        return self.repeats or (2 if self.quick else 5)


@dataclass
class Goal:
    """One goal of the issue that asked for the benchmark: reported met / not met."""

    name: str  # what is measured, e.g. "int8 vs ORT fp32, batch 8"
    value: float | None  # the measurement (None: could not be measured here)
    target: str  # e.g. ">= 1.8x"
    met: bool | None  # None: not measured

    @classmethod
    def at_least(cls, name: str, value: float | None, bound: float, unit: str = "x") -> "Goal":
        return cls(name, value, f">= {bound:g}{unit}", None if value is None else value >= bound)

    @classmethod
    def at_most(cls, name: str, value: float | None, bound: float, unit: str = "x") -> "Goal":
        return cls(name, value, f"<= {bound:g}{unit}", None if value is None else value <= bound)


@dataclass
class Section:
    """A section's results: ``rows`` become its markdown table, ``ratios`` and ``goals`` the summary.

    Rows are flat dicts of str/int/float/bool/None (one column per key). Keys the plots read:
    ``runtime``, ``batch``, ``ms_per_image`` (latency plot), ``peak_rss_mb`` / ``peak_gpu_mb``
    (memory plot), ``agreement`` with ``ms_per_image`` (agreement vs speed plot)."""

    name: str
    config: dict = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)
    ratios: dict[str, float | None] = field(default_factory=dict)
    goals: list[Goal] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds of each of ``fns``, run round-robin so a noisy neighbour hits all of them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (MB).

    ``/proc/self/status`` VmHWM, not ``ru_maxrss``: Linux carries ru_maxrss over fork + exec, so a
    child of a big process would report its parent's size."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def current_rss_mb() -> float:
    """This process's resident memory now (MB)."""
    try:
        with open("/proc/self/statm") as handle:
            pages = int(handle.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / (1 << 20)
    except OSError:
        return peak_rss_mb()


def set_threads(threads: int | None) -> int:
    """Pin torch's intra-op threads (ONNX Runtime sessions take ``threads`` themselves)."""
    count = threads or len(os.sched_getaffinity(0))
    try:
        import torch

        torch.set_num_threads(count)
    except ImportError:
        pass
    return count


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator



def save_figure(fig, folders: list[Path], name: str) -> list[str]:
    """A matplotlib figure as PNG ``name`` into each folder (made if missing, written atomically), closed;
    the paths written, for a section's ``config["plots"]``."""
    import io

    import matplotlib.pyplot as plt

    from fedmvp.atomic import write_bytes

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    written = []
    for folder in folders:
        Path(folder).mkdir(parents=True, exist_ok=True)
        written.append(str(write_bytes(Path(folder) / name, buffer.getvalue())))
    return written
