"""One `grpo.train` run, in its own process, for `bench_memory.py`: the peak resident memory
of each phase of a step.

Usage (the benchmark writes the config): python benchmarks/_memory_child.py CONFIG.yaml RESULT.json [SECTION.KEY=VALUE ...]

Linux only: before each phase the process's high-water mark (VmHWM) is reset (writing 5 to
/proc/self/clear_refs) and read when the phase ends, so each phase's number is the most this
process held while it ran, whatever ran before. Phases: `build` (loading the policy, the
reference and the optimizer), `sample` (the rollouts), `passes` (the no-grad passes: the
reference's log-probs, the old policy's), `update` (forward, backward and optimizer step),
`other` (everything between: scoring, logging, checkpoints). `runtime` is the resident
memory as the first weights start loading: torch, transformers, grpo, the code of the
model's architecture (which transformers imports as a model starts loading: for Qwen2 and
Llama about 100 MB more, torch's DTensor, dynamo and sympy among it), the tokenizer (about
50 MB for a 151,936-token vocabulary), the rewards and the data read: what any run of this
model holds besides its models' states. `runtime_bare` is the same before the model's code
and the tokenizer (how stops 44-48 read it, 2026-12-05 and before).
The result: {"allocator", "runtime_mb", "runtime_bare_mb", "phases": {name: peak MB over the steps}, "peak_mb", "steps"}.

With MEMORY_LIVE=1 in the environment the last step's update runs under torch's memory
profiler, and the result gains "live": the bytes of the tensors live at that update's peak
(those alive as it starts, counted once per storage, plus the most the update added, tensor
by tensor), with the profiler's categories at that moment. The profiler's own memory would
inflate the resident peaks, so no phase is recorded from then on: the phases are the steps'
before it. It reads torch's private `_memory_profile()`, a benchmark's liberty.
"""

from __future__ import annotations

import functools
import json
import os
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
        self.frozen = False  # no more records (the live profile runs)

    def _record(self, name: str) -> None:
        if self.frozen:
            return
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


def _tensor_bytes() -> int:
    """The bytes of every tensor the garbage collector can reach, each storage once."""
    import gc

    import torch

    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _profiled_growth(profiler) -> tuple[int, dict]:
    """The most the profiled code added to the live tensor bytes, and the bytes by category
    (of everything the profiler saw) at that moment."""
    from torch.profiler._memory_profiler import Action

    memory = profiler._memory_profile()
    categories = memory._categories
    sizes, by_category = {}, {}
    start = total = peak = 0
    at_peak = {}
    for _, action, (key, version), size in memory.timeline:
        if key.device.type != "cpu":
            continue
        name = str(categories.get(key, version)).removeprefix("Category.").lower()
        if action == Action.PREEXISTING:
            start += size
        if action in (Action.PREEXISTING, Action.CREATE):
            sizes[key] = (size, name)
            total += size
            by_category[name] = by_category.get(name, 0) + size
        elif action == Action.INCREMENT_VERSION:
            old_size, old_name = sizes.get(key, (size, name))
            new_name = str(categories.get(key, version + 1)).removeprefix("Category.").lower()
            by_category[old_name] = by_category.get(old_name, 0) - old_size
            by_category[new_name] = by_category.get(new_name, 0) + old_size
            sizes[key] = (old_size, new_name)
        elif action == Action.DESTROY:
            old_size, old_name = sizes.pop(key, (size, name))
            total -= old_size
            by_category[old_name] = by_category.get(old_name, 0) - old_size
        if total > peak:
            peak, at_peak = total, dict(by_category)
    return peak - start, {k: v for k, v in at_peak.items() if v > 0}


def live_update(update, phases: Phases, steps: int, live: dict):
    """`update` (the step's), its last call profiled into `live` (MB)."""
    calls = [0]

    @functools.wraps(update)
    def profiled(*args, **kwargs):
        calls[0] += 1
        if calls[0] < steps:
            return update(*args, **kwargs)
        from torch.profiler import ProfilerActivity, profile

        phases.frozen = True
        before = _tensor_bytes()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as p:
            result = update(*args, **kwargs)
        growth, categories = _profiled_growth(p)
        live.update(
            {
                "at_start_mb": before / MB,
                "peak_mb": (before + growth) / MB,
                "profiled_at_peak_mb": {k: v / MB for k, v in sorted(categories.items(), key=lambda kv: -kv[1])},
            }
        )
        return result

    return profiled


MB = 1 << 20


def _import_architecture(model: str) -> None:
    """Import the code of `model`'s architecture, as transformers does when its weights start
    loading, so that the runtime read after it counts it."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(model))]


def main(config_path: str, result_path: str, *overrides: str) -> None:
    from grpo.infra import allocator

    # as `grpo train` does: re-executed under mimalloc on a CPU unless GRPO_ALLOCATOR=system
    allocator.preload(["train", config_path, *(f"--set={override}" for override in overrides)])
    import torch  # noqa: F401 - the runtime: what every run imports before a model
    import transformers  # noqa: F401

    import grpo
    import grpo.train.models as models
    import grpo.train.loop as loop
    import grpo.train.rollouts as rollouts
    import grpo.train.step as step

    phases = Phases()
    runtime = {}
    build = phases.wrap("build", loop.build_engine)
    load_tokenizer = models.load_tokenizer

    def measured_tokenizer(model: str, *args, **kwargs):  # the first thing build_engine loads
        if "mb" in runtime:
            return load_tokenizer(model, *args, **kwargs)
        runtime["bare_mb"] = _status("VmRSS")
        _import_architecture(model)
        tokenizer = load_tokenizer(model, *args, **kwargs)
        runtime["mb"] = _status("VmRSS")
        return tokenizer

    models.load_tokenizer = measured_tokenizer
    loop.build_engine = build
    rollouts.Rollouts.take = phases.wrap("sample", rollouts.Rollouts.take)
    step._passes = phases.wrap("passes", step._passes)
    step._update = phases.wrap("update", step._update)
    live = {}
    if os.environ.get("MEMORY_LIVE") == "1":
        steps = grpo.config.load_config(config_path, list(overrides)).train.steps
        step._update = live_update(step._update, phases, steps, live)
    _reset()
    start = time.perf_counter()
    result = grpo.train(config_path, overrides=list(overrides), progress=False)
    phases._record("other")
    Path(result_path).write_text(
        json.dumps(
            {
                "allocator": allocator.active(),
                "runtime_mb": runtime["mb"],
                "runtime_bare_mb": runtime["bare_mb"],
                "phases": phases.peaks,
                "peak_mb": max(phases.peaks.values()),
                "wall_s": time.perf_counter() - start,
                "steps": result.metrics,
                **({"live": live} if live else {}),
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
