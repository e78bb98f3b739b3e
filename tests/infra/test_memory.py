"""train.return_freed_memory: freed tensors' memory goes back to the system (Linux, glibc);
release_free_memory, once a step: what the allocator kept freed goes back at that moment."""

import os
import subprocess
import sys
import textwrap

import pytest

import grpo
from grpo.infra.allocator import library

FRAGMENT = textwrap.dedent(
    """
    import re, sys
    from pathlib import Path
    import torch
    from grpo.infra.memory import release_free_memory, return_freed_memory

    def rss():
        return int(re.search(r"VmRSS:\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024

    if sys.argv[1] == "on":
        assert return_freed_memory()
    big = torch.ones(2 << 20)  # 8 MiB: glibc maps it, and on its free raises its threshold to 8 MiB
    del big
    start = rss()
    held = [torch.ones(1 << 20) for _ in range(50)]  # 50 x 4 MiB, each touched
    last = held.pop()  # kept: the heap's top stays in use
    del held
    if sys.argv[1] == "release":
        release_free_memory()
    print(rss() - start)
    """
)


def resident_after_free(setting: str, preload: str | None = None) -> float:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if preload:
        env["LD_PRELOAD"] = preload
    done = subprocess.run(
        [sys.executable, "-c", FRAGMENT, setting], capture_output=True, text=True, check=True, env=env
    )
    return float(done.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_tensors_memory_goes_back_to_the_system():
    """49 freed 4 MiB tensors (196 MiB): glibc keeps them resident in its heap by default;
    with the setting each was its own mapping, unmapped when freed."""
    kept, returned = resident_after_free("off"), resident_after_free("on")
    assert kept > 150 and returned < 20, (kept, returned)


@pytest.mark.skipif(not sys.platform.startswith("linux") or library() is None, reason="mimalloc preloads on Linux")
def test_under_mimalloc_freed_memory_is_purged_at_once():
    """mimalloc (the `grpo` command's allocator) keeps freed pages ~10 ms (100 ms for large
    blocks) before it decommits them; with the setting its purge delay is 0."""
    kept, returned = resident_after_free("off", library()), resident_after_free("on", library())
    assert kept > 150 and returned < 20, (kept, returned)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's and mimalloc's calls")
@pytest.mark.parametrize("allocator", ["glibc", "mimalloc"])
def test_released_memory_goes_back_under_either_allocator(allocator):
    """Kept resident after the free (as above), given back by the call."""
    preload = library() if allocator == "mimalloc" else None
    if allocator == "mimalloc" and preload is None:
        pytest.skip("mimalloc is not installed")
    kept, released = resident_after_free("off", preload), resident_after_free("release", preload)
    assert kept > 150 and released < 20, (kept, released)


def test_each_step_releases_after_its_update(make_config, monkeypatch):
    import grpo.train.step

    order = []
    update = grpo.train.step._update
    monkeypatch.setattr("grpo.train.step._update", lambda *a: order.append("update") or update(*a))
    monkeypatch.setattr("grpo.train.step.release_free_memory", lambda: order.append("release"))
    grpo.train(make_config(train={"steps": 2}), progress=False)
    assert order == ["update", "release"] * 2


def test_the_run_sets_it_before_any_model_loads(make_config, monkeypatch):
    order = []
    monkeypatch.setattr("grpo.train.loop.return_freed_memory", lambda: order.append("set"))
    real = grpo.train.loop.build_engine
    monkeypatch.setattr("grpo.train.loop.build_engine", lambda *a, **k: order.append("build") or real(*a, **k))
    grpo.train(make_config(train={"steps": 1, "return_freed_memory": True}), progress=False)
    assert order == ["set", "build"]
    order.clear()
    grpo.train(make_config(train={"steps": 1}), overwrite=True, progress=False)
    assert order == ["build"]
