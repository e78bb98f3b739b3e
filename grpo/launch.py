"""The `grpo` command's entry point (the console script and `python -m grpo`): the memory
allocator first (`grpo.infra.allocator`, which may re-execute the command under mimalloc
before anything heavy is imported), then the command line (`grpo.cli`)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from grpo.infra.allocator import preload

    preload()
    from grpo.cli import main as cli

    return cli(argv)
