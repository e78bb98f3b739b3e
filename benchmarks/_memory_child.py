"""One `grpo.train` run, in its own process, for `bench_memory.py`: the peak resident memory
of each phase of a step.

Usage (the benchmark writes the config): python benchmarks/_memory_child.py CONFIG.yaml RESULT.json [SECTION.KEY=VALUE ...]

Linux only: before each phase the process's high-water mark (VmHWM) is reset (writing 5 to
/proc/self/clear_refs) and read when the phase ends, so each phase's number is the most this
process held while it ran, whatever ran before. Phases: `build` (loading the policy, the
reference and the optimizer), `sample` (the rollouts), `passes` (the no-grad passes: the
reference's log-probs, the old policy's), `update` (forward, backward and optimizer step),
`other` (everything between: scoring, logging, checkpoints). `runtime` is the resident
memory as the first model starts loading (torch, transformers, grpo, the tokenizer, the
rewards and the data read): what the run holds besides its models' states.
The result: {"allocator", "runtime_mb", "phases": {name: peak MB over the steps}, "peak_mb", "steps"}.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from pathlib import Path


def _status(key: str) -> float:
    found = re.search(rf"^{key}:\s+(\d+)\s+kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    return int(found.group(1)) / 1024


def _reset() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark back to the resident size


class Phases:
    """The peak of each phase, the 'other' phase being whatever runs between two phases."""

    def __init__(self):
        self.peaks: dict[str, float] = {}

    def _record(self, name: str) -> None:
        self.peaks[name] = max(self.peaks.get(name, 0.0), _status("VmHWM"))
        _reset()

    def wrap(self, name: str, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            self._record("other")
            try:
                return function(*args, **kwargs)
            finally:
                self._record(name)

        return timed


def main(config_path: str, result_path: str, *overrides: str) -> None:
    from grpo.infra import allocator

    allocator.preload()  # as the `grpo` command does: re-executed under mimalloc unless GRPO_ALLOCATOR=system
    import torch  # noqa: F401 - the runtime: what every run imports before a model
    import transformers  # noqa: F401

    import grpo
    import grpo.train.loop as loop
    import grpo.train.rollouts as rollouts
    import grpo.train.step as step

    phases = Phases()
    runtime = {}
    build = phases.wrap("build", loop.build_engine)

    def measured_build(*args, **kwargs):
        runtime.setdefault("mb", _status("VmRSS"))
        return build(*args, **kwargs)

    loop.build_engine = measured_build
    rollouts.Rollouts.take = phases.wrap("sample", rollouts.Rollouts.take)
    step._passes = phases.wrap("passes", step._passes)
    step._update = phases.wrap("update", step._update)
    _reset()
    start = time.perf_counter()
    result = grpo.train(config_path, overrides=list(overrides), progress=False)
    phases._record("other")
    Path(result_path).write_text(
        json.dumps(
            {
                "allocator": allocator.active(),
                "runtime_mb": runtime["mb"],
                "phases": phases.peaks,
                "peak_mb": max(phases.peaks.values()),
                "wall_s": time.perf_counter() - start,
                "steps": result.metrics,
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
