"""The memory allocator the `grpo` command runs under: mimalloc where it is installed.

PyTorch's CPU tensors come from the C library's `malloc`. glibc's keeps freed blocks in a
heap that fragments: at SmolLM2-135M-Instruct's peak it held 734 MB freed but resident, and
a run's resident memory grows step after step (docs/memory.md). mimalloc (Microsoft's
allocator, the `cmeel-mimalloc` wheel) holds less there, the step as long
(benchmarks/README.md#memory has both measured).

An allocator must be chosen before the program starts, so the `grpo` command (and
`python -m grpo`) re-executes itself once with mimalloc in `LD_PRELOAD`, before it imports
torch; the command then runs as it would have, in the same process (same PID, arguments,
environment). `GRPO_ALLOCATOR` chooses: `mimalloc` (the default where the library is
installed, on Linux), `system` (the C library's). torchrun's workers keep the system
allocator (docs/memory.md says why). Python code that calls `grpo.train`
runs under whatever allocator its own process started with; `library()` gives the path to
preload (`LD_PRELOAD=... python script.py`).

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
    """`mimalloc` where a mimalloc library is mapped into this process, else `system`."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    return "mimalloc" if "libmimalloc" in maps else "system"


def wanted() -> str:
    """The allocator `GRPO_ALLOCATOR` asks for; an unknown name is a one-line error."""
    value = os.environ.get(ENV, "").strip().lower()
    if value and value not in CHOICES:
        sys.exit(f"grpo: error: {ENV}={os.environ[ENV]!r}: choose one of {', '.join(CHOICES)}")
    return value or "mimalloc"


def preload() -> None:
    """Re-execute this command under mimalloc where it is wanted, installed and not yet in
    use; otherwise return. Where the library was asked for by name and is missing, a one-line
    error. In the re-executed process, LD_PRELOAD is given back its earlier value, so that
    the processes the command starts choose for themselves."""
    if _WAS in os.environ:  # we are the re-executed command: the environment as it was
        was = os.environ.pop(_WAS)
        if was:
            os.environ["LD_PRELOAD"] = was
        else:
            os.environ.pop("LD_PRELOAD", None)
    if os.environ.pop(_TRIED, None) or not sys.platform.startswith("linux"):
        return
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        # torchrun's workers keep the system allocator: two full test runs under mimalloc had a
        # 2-process run's rank abort ("terminate called without an active exception"), once each.
        return
    if wanted() != "mimalloc" or active() == "mimalloc":
        return
    path = library()
    if path is None:
        if os.environ.get(ENV):  # asked for by name
            sys.exit(f"grpo: error: {ENV}=mimalloc: the library is not installed (pip install cmeel-mimalloc)")
        return
    if any("malloc" in part for part in os.environ.get("LD_PRELOAD", "").split(":")):
        return  # the user preloads an allocator of their own (jemalloc, tcmalloc)
    env = dict(os.environ)
    env[_WAS] = env.get("LD_PRELOAD", "")
    env["LD_PRELOAD"] = ":".join(filter(None, [path, env[_WAS]]))
    # Arenas committed as they are touched, not ahead: lower peaks and no slower (measured in
    # benchmarks/README.md#memory); a value the user set is kept.
    env.setdefault("MIMALLOC_ARENA_EAGER_COMMIT", "0")
    env[_TRIED] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(getattr(sys, "orig_argv", [sys.executable, *sys.argv])), env)
