"""The `grpo` command: parses arguments and dispatches; it holds no logic of its own."""

from __future__ import annotations

import argparse
import sys

from grpo import __version__
from grpo.errors import UserError

DESCRIPTION = """\
Reinforcement-learning fine-tuning of language models with GRPO (Group Relative Policy
Optimization, DeepSeekMath) and PPO, on one engine.

GRPO is PPO with three changes: the value model goes, the baseline becomes the mean (and
std) of a group of G sampled outputs for the same prompt, and the KL penalty moves from the
per-token reward into the loss. The reward model stays.
"""

EPILOG = """\
The math (advantages, KL estimators, clipped losses, pass@k, maj@k) is available from
Python today as grpo.algo and grpo.eval. Training, evaluation and the demo commands are
added to this command as they land; see README.md.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"grpo {__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        handler = getattr(args, "handler", None)
        if handler is None:
            parser.print_help()
            return 0
        return int(handler(args) or 0)
    except UserError as err:
        print(f"grpo: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("grpo: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
