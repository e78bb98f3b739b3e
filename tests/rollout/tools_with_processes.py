"""Tools that start processes, as code-execution tools do: each under the name `multiply` (the
tiny tool model's tool, whose schema its prompt shows), in a module that does not import torch.

`pooled` computes in a process pool of its own for each call; `kept` keeps one pool for the
process's life and, where $GRPO_TEST_PIDS names a file, writes there the pid of the process
that calls it and of its pool's process, then takes its time (the caller is in a tool's call
when the test kills its trainer).
"""

import operator
import os
import time
from concurrent.futures import ProcessPoolExecutor

from grpo.tasks.multiply import multiply  # the docstring the tool model saw (grpo.tasks is light: no torch)

_kept: list[ProcessPoolExecutor] = []


def pooled(a: int, b: int) -> int:
    with ProcessPoolExecutor(max_workers=1) as pool:
        return pool.submit(operator.mul, a, b).result()


def kept(a: int, b: int) -> int:
    if not _kept:
        _kept.append(ProcessPoolExecutor(max_workers=1))
    pool = _kept[0]
    path = os.environ.get("GRPO_TEST_PIDS")
    if path:
        child = pool.submit(os.getpid).result()
        with open(path + ".part", "w") as f:
            f.write(f"{os.getpid()} {child}\n")
        os.replace(path + ".part", path)
        time.sleep(60)
    return pool.submit(operator.mul, a, b).result()


for tool in (pooled, kept):
    tool.__name__, tool.__doc__ = "multiply", multiply.__doc__
