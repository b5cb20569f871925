"""Batch size "auto": the largest batch whose real forward/backward fits the GPU memory limit.

Estimating activation memory from the graph is fragile (checkpointing, autocast, allocator
caching), so batches are measured instead: doubling sizes each run one real step on copies of
the LoRA and the peak CUDA memory is compared with the limit. Needs torch only when probing;
`find_batch_size` itself is pure and tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from edge_client.train_options import TrainingError

CPU_AUTO_BATCH = 32
MAX_AUTO_BATCH = 1024


def find_batch_size(probe: Callable[[int], int], cap: int, max_bytes: int, start: int = 1) -> int:
    """Largest batch (doubling from ``start`` up to ``cap``) whose ``probe(batch)`` peak bytes stay
    within ``max_bytes``; a probe raising MemoryError (CUDA OOM included) counts as over."""
    best, batch = 0, max(1, min(start, cap))
    while True:
        try:
            peak = probe(batch)
        except MemoryError:
            break
        if peak > max_bytes:
            break
        best = batch
        if batch >= cap:
            break
        batch = min(batch * 2, cap)
    if best == 0:
        raise TrainingError(f"batch 1 does not fit in {max_bytes / 2**30:.2f} GiB; raise --max-memory-gb")
    return best


def probe_step(torch: Any, dev: Any, batch: int, n: int, batch_tensors: Callable, forward_loss: Callable,
               lora: dict[str, Any]) -> int:
    """Peak bytes of one forward/backward at ``batch`` (CUDA), on copies of the LoRA; CUDA out of
    memory becomes MemoryError, which `find_batch_size` reads as "too big"."""
    tensors = {k: v.detach().clone().requires_grad_(True) for k, v in lora.items()}
    index = torch.arange(batch) % n
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    try:
        x, view, y = batch_tensors(index, torch.zeros(batch, dtype=torch.bool))
        forward_loss(x, view, y, tensors).backward()
        torch.cuda.synchronize(dev)
        return int(torch.cuda.max_memory_allocated(dev))
    except torch.cuda.OutOfMemoryError:
        raise MemoryError(f"batch {batch}") from None
    finally:
        del tensors
        torch.cuda.empty_cache()


def auto_batch(torch: Any, dev: Any, n: int, max_memory_gb: float | None, probe: Callable[[int], int]) -> int:
    """``batch_size="auto"``: on CUDA the largest probed batch under ``max_memory_gb`` (default 90% of
    what is free), on CPU (where memory is rarely the limit) `CPU_AUTO_BATCH`; never more than ``n``."""
    cap = min(n, MAX_AUTO_BATCH)
    if dev.type != "cuda":
        return min(n, CPU_AUTO_BATCH)
    if max_memory_gb is None:
        free, _total = torch.cuda.mem_get_info(dev)
        limit = int(0.9 * (free + torch.cuda.memory_allocated(dev)))
    else:
        limit = int(max_memory_gb * 2**30)
    return find_batch_size(probe, cap, limit)
