"""The memory allocator the `grpo` command runs under: mimalloc for CPU training, where installed.

PyTorch's CPU tensors come from the C library's `malloc`. glibc's keeps freed blocks in a
heap that fragments: a CPU training run's resident memory sits well above what its tensors
hold and grows step after step (docs/memory.md). mimalloc (Microsoft's allocator, the
`cmeel-mimalloc` wheel) holds less there, the step as long (benchmarks/README.md#memory).
That is the one place it was measured to help, so that is where it is used: the commands
that train (`train`, `sft`, `demo`, `compare`, and the helper that forks the demo's runs)
on a CPU, i.e. `train.device` (or `--device`) `cpu`, or `auto` on a host with no GPU
device. Not under a GPU run (its tensors are the GPU allocator's; only the host's small
ones would move), not for `vllm-serve`, `eval` or the other commands (nothing measured),
not in torchrun's workers (below).

An allocator must be chosen before the program starts, so the command re-executes itself
once with mimalloc in `LD_PRELOAD`, before it imports torch; it then runs as it would have,
in the same process (same PID, arguments, environment), and gives LD_PRELOAD back its
earlier value, so that the processes it starts (a vLLM server, spawned workers) choose for
themselves. Where the re-execution fails, the command runs on under the allocator it has,
after one warning line. `GRPO_ALLOCATOR` chooses: unset, mimalloc where it helps (above);
`mimalloc`, for every command; `system`, the C library's. An allocator the user preloads (jemalloc, tcmalloc) is left alone and named
by `active()`. Python code that calls `grpo.train` runs under whatever allocator its own
process started with; `library()` gives the path to preload.

torchrun's workers keep the C library's allocator: two 2-process test runs under mimalloc
each had a worker abort with libstdc++'s "terminate called without an active exception"
(std::terminate with no exception in flight, as when a C++ thread object is destroyed
while its thread still runs), never reproduced alone. mimalloc reports its own failures as
"mimalloc: error:" and printed none: more likely a race whose timing it changed than its
own failure; the cause was not found, so no such run preloads it (docs/memory.md).

Imports nothing heavy: it runs before the command's imports.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

ENV = "GRPO_ALLOCATOR"
CHOICES = ("mimalloc", "system")
_TRIED = "GRPO_ALLOCATOR_TRIED"  # set across the re-exec: never try twice
_WAS = "GRPO_ALLOCATOR_LD_PRELOAD_WAS"  # LD_PRELOAD before ours, restored for the children

# The commands that train (or fork training runs): where mimalloc was measured to help, on a CPU.
TRAINS = ("train", "sft", "demo", "compare")
# The allocators a process may have been started under, by the name of their library.
KNOWN = ("mimalloc", "jemalloc", "tcmalloc")


def library() -> str | None:
    """The path of the installed mimalloc shared library, or None."""
    from importlib import metadata

    try:
        files = metadata.distribution("cmeel-mimalloc").files or []
    except metadata.PackageNotFoundError:
        return None
    found = sorted(f for f in files if f.name.startswith("libmimalloc.so"))
    for file in found:  # the shortest name first: libmimalloc.so, then its versioned names
        path = Path(file.locate())
        if path.exists():
            return str(path.resolve())
    return None


@functools.cache  # fixed when the process starts: read /proc/self/maps once
def active() -> str:
    """The allocator this process runs under: `mimalloc`, `jemalloc` or `tcmalloc` where its
    library is mapped into the process, else `system` (the C library's)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    return next((name for name in KNOWN if f"lib{name}" in maps), "system")


def wanted() -> str:
    """The allocator `GRPO_ALLOCATOR` asks for; an unknown name is a one-line error."""
    value = os.environ.get(ENV, "").strip().lower()
    if value and value not in CHOICES:
        sys.exit(f"grpo: error: {ENV}={os.environ[ENV]!r}: choose one of {', '.join(CHOICES)}")
    return value or "mimalloc"


def helps(argv: list[str]) -> bool:
    """Whether the `grpo` command with arguments `argv` (the subcommand first) trains on a CPU:
    where mimalloc was measured to hold less (the module's docstring)."""
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    if command not in TRAINS:
        return False
    device = _device(command, argv)
    return device == "cpu" or (device == "auto" and not _gpu_visible())


def _device(command: str, argv: list[str]) -> str:
    """The device the command asks for, as cheaply as it can be read before the command
    parses its arguments: `--device`, the last `--set train.device=...`, else (`train`) the
    config file's `train.device`; `auto` where none says (or the file does not read: the
    command will say why itself)."""
    device, overrides, positional = None, [], []
    args = iter(argv)
    for arg in args:
        name, equals, value = arg.partition("=")
        if name in ("--device", "--set"):
            value = value if equals else next(args, "")
            if name == "--device":
                device = value
            else:
                overrides.append(value)
        elif not arg.startswith("-"):
            positional.append(arg)
    for override in overrides:
        key, _, value = override.partition("=")
        if key.strip() == "train.device":
            device = value.strip().strip("'\"")
    if device or command != "train" or len(positional) < 2:
        return (device or "auto").strip().lower()
    try:
        import yaml

        config = yaml.safe_load(Path(positional[1]).read_text()) or {}
        return str(config.get("train", {}).get("device", "auto")).strip().lower()
    except Exception:  # noqa: BLE001 - unreadable, or not a mapping: the command itself will say
        return "auto"


def _gpu_visible() -> bool:
    """Whether a GPU device may be visible to torch, without importing torch: an NVIDIA or ROCm
    device node, unless CUDA_VISIBLE_DEVICES hides every device."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return any(Path(node).exists() for node in ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg"))


def _preloaded() -> str | None:
    """The allocator the user preloads (LD_PRELOAD naming jemalloc, tcmalloc, mimalloc, or any
    library with malloc in its name), by name, or None."""
    for part in os.environ.get("LD_PRELOAD", "").replace(" ", ":").split(":"):
        base = Path(part).name
        if "malloc" in base:
            return next((name for name in KNOWN if name in base), base)
    return None


def preload(argv: list[str] | None = None) -> None:
    """Re-execute this command under mimalloc where it helps (`helps(argv)`; argv: the
    command's arguments, sys.argv[1:] by default) or GRPO_ALLOCATOR=mimalloc asks for it, where
    it is installed and no allocator is in use or preloaded already; otherwise return. Where the library was asked for by name
    and is missing, a one-line error; where the re-execution fails, one warning line and the
    command runs on as it is. In the re-executed process, LD_PRELOAD is given back its earlier
    value, so that the processes the command starts choose for themselves."""
    if _WAS in os.environ:  # we are the re-executed command: the environment as it was
        was = os.environ.pop(_WAS)
        if was:
            os.environ["LD_PRELOAD"] = was
        else:
            os.environ.pop("LD_PRELOAD", None)
    if os.environ.pop(_TRIED, None) or not sys.platform.startswith("linux"):
        return
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        return  # torchrun's workers keep the system allocator (the module's docstring says why)
    if wanted() != "mimalloc" or active() != "system" or _preloaded() is not None:
        return  # not wanted, or an allocator of the user's (or ours) already in place: never two
    if not os.environ.get(ENV) and not helps(sys.argv[1:] if argv is None else argv):
        return  # the default, mimalloc where it helps; asked for by name, for any command
    path = library()
    if path is None:
        if os.environ.get(ENV):  # asked for by name
            sys.exit(f"grpo: error: {ENV}=mimalloc: the library is not installed (pip install cmeel-mimalloc)")
        return
    env = dict(os.environ)
    env[_WAS] = env.get("LD_PRELOAD", "")
    env["LD_PRELOAD"] = ":".join(filter(None, [path, env[_WAS]]))
    # Arenas committed as they are touched, not ahead: lower peaks and no slower (measured in
    # benchmarks/README.md#memory); a value the user set is kept.
    env.setdefault("MIMALLOC_ARENA_EAGER_COMMIT", "0")
    env[_TRIED] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, list(getattr(sys, "orig_argv", [sys.executable, *sys.argv])), env)
    except OSError as err:  # the interpreter cannot be executed again (gone, a seccomp policy): run on as we are
        print(
            f"grpo: warning: could not restart under mimalloc ({err.strerror or err}); running under the "
            f"system allocator ({ENV}=system says this without the attempt)",
            file=sys.stderr,
        )
