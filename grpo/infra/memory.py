"""Peak memory of this process, the number `memory/peak_mb` reports."""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory_mb(device: torch.device | str = "cpu") -> float:
    """Peak memory in MiB where the run's tensors live: on a GPU, the peak memory torch has
    allocated on it (`torch.cuda.max_memory_allocated`: models, activations, optimizer state,
    KV cache; not the allocator's cached reserve); on a CPU, the peak resident memory of the
    process, the honest measure there (it includes Python and the libraries, a fixed overhead).
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / (1 << 20)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1 << 20) if sys.platform == "darwin" else rss / 1024  # bytes on macOS, KiB on Linux
