"""The `grpo` command's entry point (the console script and `python -m grpo`): the memory
allocator first (`grpo.infra.allocator`, which may re-execute a CPU training command under
mimalloc before anything heavy is imported), then the command line (`grpo.cli`)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from grpo.infra.allocator import preload

    if argv is None:  # the command itself; never re-execute a program that calls main(argv)
        preload(sys.argv[1:])
    from grpo.cli import main as cli

    return cli(argv)
