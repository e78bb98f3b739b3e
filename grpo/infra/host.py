"""What machine a measurement ran on: the CPU's name and the vector extensions that decide its
speed, so that numbers from different hosts are compared only when these agree.

Hosts differ in these: a CPU with only AVX2 runs the same run slower than one with AVX-512
(and AVX512-BF16), and its float results differ (benchmarks/README.md says by how much). Benchmarks and the demo's summary.json record this.
"""

from __future__ import annotations

import os

# The extensions that decide matmul speed: AVX2 alone has no bf16 arithmetic, AVX512-BF16 and AMX do.
VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_model() -> dict:
    """{"cpu_model": name, "cpu_flags": the VECTOR_FLAGS it has} from /proc/cpuinfo (the first
    processor's block); {} where there is none (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]
    except OSError:
        return {}
    fields = {key.strip(): value for key, value in (line.split(":", 1) for line in first.splitlines() if ":" in line)}
    flags = set(fields.get("flags", "").split())
    return {"cpu_model": fields.get("model name", "").strip(), "cpu_flags": [f for f in VECTOR_FLAGS if f in flags]}


def describe_host() -> dict:
    """cpu_model() with the number of CPUs this process may use, torch's version and the memory
    allocator this process runs under (grpo.infra.allocator)."""
    import torch

    from grpo.infra.allocator import active

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {**cpu_model(), "cpus": cpus, "torch": torch.__version__, "allocator": active()}
