"""Peak memory of a training step: the CUDA allocator's high-water mark, and the process's peak RSS.

- ``peak_mem_bytes``: ``torch.cuda.max_memory_allocated`` (tensors, not the allocator's cached reserve)
  since ``reset_peak_memory`` at the start of the step: each step's own peak. None off CUDA.
- ``peak_rss_bytes``: ``getrusage(RUSAGE_SELF).ru_maxrss``, the process's resident-set high-water
  mark since it started (it cannot be reset): on a CPU run, the memory the training takes.

Both are per rank; ``peak_memory`` with the layout gives the maximum over the ranks (one small
all-reduce), which is what a run must fit.
"""

from __future__ import annotations

import resource
import sys

import torch
import torch.distributed as dist
from xprep.train.dist import ParallelDims


def reset_peak_memory(device: torch.device) -> None:
    """Start a new CUDA high-water mark (no device sync); nothing to do elsewhere."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def peak_memory(device: torch.device, dims: ParallelDims | None = None) -> tuple[int | None, int]:
    """(CUDA max allocated since the last reset or None off CUDA, peak RSS), in bytes, the maximum over all
    ranks when ``dims`` is distributed (every rank must call it then)."""
    cuda = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else -1
    values = [cuda, peak_rss_bytes()]
    if dims is not None and dims.distributed:
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        values = [int(v) for v in t.tolist()]
    return (values[0] if values[0] >= 0 else None), values[1]
