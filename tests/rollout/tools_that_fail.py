"""Tools that fail as a process can: each one under the name `multiply` (the tiny tool
model's tool, whose schema its prompt shows), defined at the top of a module that does not
import torch, so that a worker process (rollout.tool_isolate) starts at once."""

import ctypes
import os
import time

from grpo.tasks.multiply import multiply  # the docstring the tool model saw (grpo.tasks is light: no torch)


def exits(a: int, b: int) -> int:
    os._exit(3)


def crashes(a: int, b: int) -> int:
    return ctypes.string_at(0)  # a segfault: no Python code runs after it


def hangs(a: int, b: int) -> int:
    time.sleep(3600)
    return a * b


def forks(a: int, b: int) -> int:
    """The exit code of a forked child that calls os._exit(5): a child's os._exit is its own."""
    pid = os.fork()
    if pid == 0:
        os._exit(5)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def where(a: int, b: int) -> int:
    """The process it runs in."""
    return os.getpid()


for tool in (exits, crashes, hangs, forks, where):
    tool.__name__, tool.__doc__ = "multiply", multiply.__doc__
