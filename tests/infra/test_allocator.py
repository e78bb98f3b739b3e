"""The `grpo` command's memory allocator (grpo.infra.allocator): mimalloc preloaded by one
re-execution for CPU training where installed, GRPO_ALLOCATOR=system without it, the same
numbers either way; every guarded path falls back when what it guards is planted broken."""

import json
import shutil
import os
import subprocess
import sys

import pytest
import yaml

from grpo.infra import allocator

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or allocator.library() is None, reason="mimalloc preloads on Linux"
)

# A CPU training command's arguments: where mimalloc is preloaded by default.
CPU_TRAIN = ["train", "config.yaml", "--set", "train.device=cpu"]
# What the re-executed process sees: its allocator and the LD_PRELOAD its children inherit.
SHOW = (
    f"from grpo.infra import allocator as a; a.preload({CPU_TRAIN!r}); import os; "
    "print(a.active(), repr(os.environ.get('LD_PRELOAD')), os.getpid())"
)


def run(args, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_ALLOCATOR") and k != "LD_PRELOAD"}
    full.update(env)
    return subprocess.run(args, capture_output=True, text=True, env=full, timeout=120)


@pytest.mark.slow  # commands in processes of their own
def test_a_cpu_training_command_runs_under_mimalloc_by_default_and_under_the_system_one_when_asked(tmp_path):
    """MIMALLOC_VERBOSE=1 has mimalloc say so on stderr as it starts: the command is re-executed
    under it (and fails on its missing config as it would have); `grpo --version` is not a
    training command, and says which allocator it runs under itself, unless asked for by name."""
    command = [sys.executable, "-m", "grpo", "train", str(tmp_path / "missing.yaml"), "--set", "train.device=cpu"]
    done = run(command, MIMALLOC_VERBOSE="1")
    assert "mimalloc: process init" in done.stderr and "config file not found" in done.stderr
    done = run(command, MIMALLOC_VERBOSE="1", GRPO_ALLOCATOR="system")
    assert "mimalloc:" not in done.stderr and "config file not found" in done.stderr
    assert "memory allocator: system" in run([sys.executable, "-m", "grpo", "--version"]).stdout
    asked = run([sys.executable, "-m", "grpo", "--version"], GRPO_ALLOCATOR="mimalloc").stdout
    assert "memory allocator: mimalloc" in asked


@pytest.mark.slow  # commands in processes of their own
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
    allocator.preload(CPU_TRAIN)
    ((path, argv, env),) = calls
    assert path == sys.executable and argv == list(sys.orig_argv)
    assert env["LD_PRELOAD"] == f"{allocator.library()}:libm.so.6"
    assert env["GRPO_ALLOCATOR_LD_PRELOAD_WAS"] == "libm.so.6" and env["GRPO_ALLOCATOR_TRIED"] == "1"
    assert env["MIMALLOC_ARENA_EAGER_COMMIT"] == os.environ.get("MIMALLOC_ARENA_EAGER_COMMIT", "0")
    # Where the library did not load in the re-executed process, it does not try again.
    monkeypatch.setenv("GRPO_ALLOCATOR_TRIED", "1")
    allocator.preload(CPU_TRAIN)
    assert len(calls) == 1


def test_torchruns_workers_keep_the_system_allocator(monkeypatch):
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("a torchrun worker is not re-executed"))
    monkeypatch.setattr(allocator, "active", lambda: "system")
    monkeypatch.delenv("GRPO_ALLOCATOR", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    allocator.preload(CPU_TRAIN)


def test_missing_library_is_an_error_only_where_asked_for_by_name(monkeypatch):
    monkeypatch.setattr(allocator, "library", lambda: None)
    monkeypatch.setattr(allocator, "active", lambda: "system")
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("no library, no re-execution"))
    monkeypatch.delenv("GRPO_ALLOCATOR", raising=False)
    allocator.preload(CPU_TRAIN)  # the default: the system allocator, silently
    monkeypatch.setenv("GRPO_ALLOCATOR", "mimalloc")
    with pytest.raises(SystemExit, match="not installed"):
        allocator.preload(CPU_TRAIN)


@pytest.mark.slow  # commands in processes of their own
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


@pytest.mark.slow  # commands in processes of their own
def test_the_runs_forked_for_the_demo_get_the_commands_allocator(tmp_path):
    """The demo and `grpo compare` fork their runs from a helper (grpo.infra.forkserver): it makes
    the same choice as the command, before it imports torch."""
    from grpo.infra import forkserver

    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_ALLOCATOR") and k != "LD_PRELOAD"}
    default = "system" if allocator._gpu_visible() else "mimalloc"  # the runs train on the CPU where no GPU is seen
    for choice, expected in (("", default), ("system", "system"), ("mimalloc", "mimalloc")):
        out = tmp_path / f"version-{choice}"
        with forkserver.ForkServer(env={**env, "GRPO_ALLOCATOR": choice}) as server:
            assert server.run(["--version"], stdout=out) == 0
        assert f"memory allocator: {expected}" in out.read_text()


def reexecutes(monkeypatch, argv, gpu=False) -> bool:
    """Whether preload(argv) re-executes the command (execve recorded, not run), on a host
    that shows a GPU device or not."""
    calls = []
    monkeypatch.setattr(os, "execve", lambda *a: calls.append(a))
    monkeypatch.setattr(allocator, "active", lambda: "system")
    monkeypatch.setattr(allocator, "_gpu_visible", lambda: gpu)
    monkeypatch.delenv("GRPO_ALLOCATOR", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    allocator.preload(argv)
    return bool(calls)


def test_mimalloc_is_preloaded_for_training_on_a_cpu_only(monkeypatch, tmp_path):
    """Where it was measured to help: the training commands on a CPU (train.device cpu, or auto
    with no GPU device); never vllm-serve, eval or a bare `grpo`, nor a run on a GPU."""
    configs = {}
    for device in ("cpu", "cuda:0", None):
        path = tmp_path / f"{device}.yaml"
        path.write_text(yaml.safe_dump({"model": "m", "train": {"device": device} if device else {"steps": 2}}))
        configs[device] = str(path)
    cases = [
        (["train", configs["cpu"]], True, True),  # asked for the CPU: even beside a GPU
        (["train", configs[None]], True, False),  # auto: the CPU where no GPU is seen
        (["train", configs["cuda:0"]], False, False),
        (["train", "--set", "train.device=cuda", configs["cpu"]], False, False),  # the override wins
        (["train", "--set=train.device=cpu", configs["cuda:0"], "--quiet"], True, True),
        (["train", str(tmp_path / "missing.yaml")], True, False),  # the command says what is missing
        (["sft", "--output", "out", "--device", "cpu"], True, True),
        (["sft", "--output", "out"], True, False),
        (["demo", "--quick"], True, False),
        (["compare", configs["cpu"], configs["cpu"]], True, False),
        (["vllm-serve", "--device", "cpu"], False, False),
        (["eval", "--device", "cpu"], False, False),
        (["rm", "train", "--device", "cpu"], False, False),
        (["--version"], False, False),
        ([], False, False),
    ]
    for argv, on_cpu, beside_gpu in cases:
        assert reexecutes(monkeypatch, argv) == on_cpu, argv
        assert reexecutes(monkeypatch, argv, gpu=True) == beside_gpu, argv


def test_asked_for_by_name_mimalloc_is_preloaded_for_any_command(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "execve", lambda *a: calls.append(a))
    monkeypatch.setattr(allocator, "active", lambda: "system")
    monkeypatch.setattr(allocator, "_gpu_visible", lambda: True)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setenv("GRPO_ALLOCATOR", "mimalloc")
    allocator.preload(["vllm-serve"])
    assert len(calls) == 1


@pytest.mark.parametrize("error", [FileNotFoundError(2, "No such file or directory"), PermissionError(1, "denied")])
def test_a_failed_re_execution_runs_on_as_it_is_with_one_warning(error, monkeypatch, capsys):
    def failing(*args):
        raise error

    monkeypatch.setattr(os, "execve", failing)
    monkeypatch.setattr(allocator, "active", lambda: "system")
    monkeypatch.setattr(allocator, "_gpu_visible", lambda: False)
    monkeypatch.delenv("GRPO_ALLOCATOR", raising=False)
    monkeypatch.setenv("LD_PRELOAD", "libm.so.6")
    allocator.preload(CPU_TRAIN)  # returns: the command runs on
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("grpo: warning: could not restart under mimalloc") and error.strerror in line
    assert os.environ["LD_PRELOAD"] == "libm.so.6"  # this process's environment untouched
    assert "GRPO_ALLOCATOR_TRIED" not in os.environ and "GRPO_ALLOCATOR_LD_PRELOAD_WAS" not in os.environ


@pytest.mark.parametrize(
    "preloaded,name",
    [
        ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "jemalloc"),
        ("libtcmalloc_minimal.so.4", "tcmalloc"),
        ("libm.so.6 /opt/lib/libtcmalloc.so", "tcmalloc"),
        ("libc_malloc_debug.so.0", "libc_malloc_debug.so.0"),
    ],
)
def test_an_allocator_the_user_preloads_is_named_and_never_stacked(preloaded, name, monkeypatch):
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("no mimalloc on top of the user's allocator"))
    monkeypatch.setattr(allocator, "active", lambda: "system")
    monkeypatch.setattr(allocator, "_gpu_visible", lambda: False)
    monkeypatch.setenv("LD_PRELOAD", preloaded)
    assert allocator._preloaded() == name
    for choice in ("", "mimalloc"):
        monkeypatch.setenv("GRPO_ALLOCATOR", choice)
        allocator.preload(CPU_TRAIN)


def test_a_preloaded_jemalloc_is_reported_by_name(tmp_path):
    """A real allocator preloaded under jemalloc's name (mimalloc's library, copied): the process
    says `jemalloc`, not `system`, and keeps it alone (no mimalloc mapped beside it)."""
    planted = tmp_path / "libjemalloc.so.2"
    shutil.copy(allocator.library(), planted)
    show = (
        f"from grpo.infra import allocator as a; a.preload({CPU_TRAIN!r}); from pathlib import Path; "
        "print(a.active(), 'libmimalloc' in Path('/proc/self/maps').read_text())"
    )
    done = run([sys.executable, "-c", show], LD_PRELOAD=str(planted))
    assert done.stdout.split() == ["jemalloc", "False"], done.stderr[-2000:]


def test_under_a_users_allocator_glibcs_settings_are_not_claimed(monkeypatch):
    """train.return_freed_memory and the release once a step call mimalloc's or glibc's
    functions; under jemalloc or tcmalloc neither reaches the allocator: not claimed."""
    from grpo.infra import memory

    monkeypatch.setattr(allocator, "active", lambda: "jemalloc")
    memory._releaser.cache_clear()
    try:
        assert memory.return_freed_memory() is False
        assert memory._releaser() is None
    finally:
        memory._releaser.cache_clear()
