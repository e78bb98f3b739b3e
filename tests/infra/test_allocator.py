"""The `grpo` command's memory allocator (grpo.infra.allocator): mimalloc preloaded by one
re-execution where installed, GRPO_ALLOCATOR=system without it, the same numbers either way."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from grpo.infra import allocator

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or allocator.library() is None, reason="mimalloc preloads on Linux"
)

# What the re-executed process sees: its allocator and the LD_PRELOAD its children inherit.
SHOW = "from grpo.infra import allocator as a; a.preload(); import os; print(a.active(), repr(os.environ.get('LD_PRELOAD')), os.getpid())"


def run(args, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_ALLOCATOR") and k != "LD_PRELOAD"}
    full.update(env)
    return subprocess.run(args, capture_output=True, text=True, env=full, timeout=120)


def test_the_command_runs_under_mimalloc_by_default_and_under_the_system_one_when_asked():
    assert "memory allocator: mimalloc" in run([sys.executable, "-m", "grpo", "--version"]).stdout
    system = run([sys.executable, "-m", "grpo", "--version"], GRPO_ALLOCATOR="system").stdout
    assert "memory allocator: system" in system


def test_the_reexecuted_process_gives_its_children_the_environment_it_started_with():
    done = run([sys.executable, "-c", SHOW])
    name, preload, _ = done.stdout.split()
    assert (name, preload) == ("mimalloc", "None")  # ours is gone from what children inherit
    done = run([sys.executable, "-c", SHOW], LD_PRELOAD="libm.so.6")
    name, preload, _ = done.stdout.split()
    assert (name, preload) == ("mimalloc", "'libm.so.6'")  # the user's kept, and restored


def test_a_preloaded_allocator_of_the_users_own_is_left_alone():
    done = run([sys.executable, "-c", SHOW], LD_PRELOAD="libc_malloc_debug.so.0")
    assert done.stdout.split()[0] == "system"


def test_an_unknown_allocator_is_a_one_line_error():
    done = run([sys.executable, "-m", "grpo", "--version"], GRPO_ALLOCATOR="jemalloc")
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        "grpo: error: GRPO_ALLOCATOR='jemalloc': choose one of mimalloc, system"
    ]


def test_it_re_executes_once_with_the_library_first_in_ld_preload(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: calls.append((path, argv, env)))
    monkeypatch.setattr(allocator, "active", lambda: "system")
    monkeypatch.delenv("GRPO_ALLOCATOR", raising=False)
    monkeypatch.setenv("LD_PRELOAD", "libm.so.6")
    allocator.preload()
    ((path, argv, env),) = calls
    assert path == sys.executable and argv == list(sys.orig_argv)
    assert env["LD_PRELOAD"] == f"{allocator.library()}:libm.so.6"
    assert env["GRPO_ALLOCATOR_LD_PRELOAD_WAS"] == "libm.so.6" and env["GRPO_ALLOCATOR_TRIED"] == "1"
    assert env["MIMALLOC_ARENA_EAGER_COMMIT"] == os.environ.get("MIMALLOC_ARENA_EAGER_COMMIT", "0")
    # Where the library did not load in the re-executed process, it does not try again.
    monkeypatch.setenv("GRPO_ALLOCATOR_TRIED", "1")
    allocator.preload()
    assert len(calls) == 1


def test_torchruns_workers_keep_the_system_allocator(monkeypatch):
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("a torchrun worker is not re-executed"))
    monkeypatch.setattr(allocator, "active", lambda: "system")
    monkeypatch.delenv("GRPO_ALLOCATOR", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    allocator.preload()


def test_missing_library_is_an_error_only_where_asked_for_by_name(monkeypatch):
    monkeypatch.setattr(allocator, "library", lambda: None)
    monkeypatch.setattr(allocator, "active", lambda: "system")
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("no library, no re-execution"))
    monkeypatch.delenv("GRPO_ALLOCATOR", raising=False)
    allocator.preload()  # the default: the system allocator, silently
    monkeypatch.setenv("GRPO_ALLOCATOR", "mimalloc")
    with pytest.raises(SystemExit, match="not installed"):
        allocator.preload()


def test_training_gives_the_same_numbers_under_either_allocator(make_config, tmp_path):
    metrics = {}
    for name in allocator.CHOICES:
        config = make_config(output_dir=str(tmp_path / name), train={"steps": 2, "sample_every": 0})
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        done = run([sys.executable, "-m", "grpo", "train", str(path), "--quiet"], GRPO_ALLOCATOR=name)
        assert done.returncode == 0, done.stderr[-2000:]
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        metrics[name] = [{k: v for k, v in row.items() if not k.startswith(("time/", "memory/"))} for row in rows]
    assert metrics["mimalloc"] == metrics["system"]
    assert len(metrics["system"]) == 2


def test_the_runs_forked_for_the_demo_get_the_commands_allocator(tmp_path):
    """The demo and `grpo compare` fork their runs from a helper (grpo.infra.forkserver): it makes
    the same choice as the command, before it imports torch."""
    from grpo.infra import forkserver

    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_ALLOCATOR") and k != "LD_PRELOAD"}
    for choice, expected in (("", "mimalloc"), ("system", "system")):
        out = tmp_path / f"version-{choice}"
        with forkserver.ForkServer(env={**env, "GRPO_ALLOCATOR": choice}) as server:
            assert server.run(["--version"], stdout=out) == 0
        assert f"memory allocator: {expected}" in out.read_text()
