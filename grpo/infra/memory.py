"""Peak memory of this process, the number `memory/peak_mb` reports."""

from __future__ import annotations

import ctypes
import functools
import re
import resource
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def peak_rss_mb() -> float:
    """This process's own peak resident memory in MiB. On Linux `VmHWM` of /proc/self/status
    (the high-water mark of this process's memory since it started its program), not
    `ru_maxrss`: a process started by another inherits its parent's peak as its own starting
    ru_maxrss (exec carries it over), so a run launched from a process that once held much
    memory would read at least that much (benchmarks/README.md). Elsewhere ru_maxrss (KiB on Linux, bytes on macOS).
    Imports nothing heavy: the benchmark's TRL child reads it before loading torch."""
    try:
        found = re.search(r"^VmHWM:\s+(\d+)\s+kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        found = None
    if found:
        return int(found.group(1)) / 1024
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1 << 20) if sys.platform == "darwin" else rss / 1024


def peak_memory_mb(device: torch.device | str = "cpu") -> float:
    """Peak memory in MiB where the run's tensors live: on a GPU, the peak memory torch has
    allocated on it (`torch.cuda.max_memory_allocated`: models, activations, optimizer state,
    KV cache; not the allocator's cached reserve); on a CPU, the peak resident memory of the
    process (`peak_rss_mb`), the honest measure there (it includes Python and the libraries, a
    fixed overhead).
    """
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / (1 << 20)
    return peak_rss_mb()


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MI_OPTION_PURGE_DELAY = 15  # mimalloc's mi_option_purge_delay (the enum keeps its numbers across versions)


def return_freed_memory(threshold: int = 256 << 10) -> bool:
    """train.return_freed_memory: from now on, in this process, freed memory goes back to the
    system at once instead of staying resident for reuse. Under mimalloc (the `grpo` command's
    allocator: grpo.infra.allocator) its purge delay becomes 0 (freed pages are decommitted as
    soon as they are free, not a second later: mimalloc 3's default). Under glibc every allocation of `threshold`
    bytes or more (a tensor's storage, mostly) becomes glibc's own mapping, unmapped when
    freed: by default glibc raises that threshold as large blocks are freed (up to 32 MiB), so
    freed tensors stay in its heap, resident, and the heap fragments: a run's resident memory
    then grows step after step above what its live tensors hold. The cost either way is fresh
    pages, faulted in, for new allocations (a slower step: docs/memory.md). True where it
    took effect (Linux with glibc or mimalloc); elsewhere nothing changes."""
    if not sys.platform.startswith("linux"):
        return False
    from grpo.infra.allocator import active

    try:
        if active() == "mimalloc":  # preloaded: its symbols are in the process's global scope
            ctypes.CDLL(None).mi_option_set(MI_OPTION_PURGE_DELAY, ctypes.c_long(0))
            return True
        if active() != "system":  # a user's jemalloc or tcmalloc: glibc's setting would not reach it
            return False
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


@functools.cache
def _releaser():
    """The allocator's call that gives its freed memory back, or None (not Linux, not glibc)."""
    if not sys.platform.startswith("linux"):
        return None
    from grpo.infra.allocator import active

    try:
        if active() == "mimalloc":
            collect = ctypes.CDLL(None).mi_collect  # mi_collect(force): freed pages decommitted now
            collect.argtypes = [ctypes.c_bool]
            return lambda: collect(True)
        if active() != "system":  # a user's jemalloc or tcmalloc: no call of theirs is known here
            return None
        trim = ctypes.CDLL("libc.so.6").malloc_trim  # every free page of glibc's heaps, not only its top
        trim.argtypes = [ctypes.c_size_t]
        return lambda: trim(0)
    except (OSError, AttributeError):
        return None


def release_free_memory() -> None:
    """Give the memory the allocator holds freed, for reuse, back to the system now. Called once
    a step, after the update: the update's transients (gradients, the head's chunks) are free by
    then, and the sampling that follows would otherwise peak on top of what the allocator
    kept of them. Pages reused later are faulted in afresh, once a step (not at every
    allocation, as train.return_freed_memory does). Does nothing where no allocator call is known."""
    release = _releaser()
    if release is not None:
        release()
