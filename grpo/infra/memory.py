"""Peak memory of this process, the number `memory/peak_mb` reports."""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory_mb() -> float:
    """Peak resident memory of the process (CPU) plus peak CUDA allocation, in MiB.

    On CPU every model, activation and optimizer state lives in the process's memory, so the
    peak RSS is the honest measure (it includes Python and the libraries, a fixed overhead).
    """
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_mb = rss / (1 << 20) if sys.platform == "darwin" else rss / 1024  # bytes on macOS, KiB on Linux
    cuda_mb = torch.cuda.max_memory_allocated() / (1 << 20) if torch.cuda.is_available() else 0.0
    return rss_mb + cuda_mb
