"""The `grpo` command: parses arguments and dispatches; it holds no logic of its own."""

from __future__ import annotations

import argparse
import json
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
The math (advantages, KL estimators, clipped losses, pass@k, maj@k) is also a Python
library: grpo.algo and grpo.eval. `grpo train --help` lists every config key.
"""

TRAIN_HELP = """\
Train a causal language model with GRPO or PPO, as CONFIG (YAML) says.

Writes into output_dir: config.yaml (resolved), metrics.jsonl (one object per step),
samples.jsonl (completions with their rewards), checkpoints/ and final/ (a Hugging Face
model directory). Ready configs: configs/grpo.yaml and configs/ppo.yaml.
"""


def _config_reference() -> str:
    from grpo.config import describe_fields

    lines = ["config keys (key = default: meaning):"]
    for key, default, doc in describe_fields():
        lines.append(f"  {key} = {default}")
        lines.append(f"      {doc}")
    return "\n".join(lines)


def _train(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from grpo.train import train

    hf_logging.disable_progress_bar()  # our own bar shows the run; no bars per weight file
    result = train(args.config, overrides=args.set, resume=args.resume, progress=not args.quiet)
    last = result.metrics[-1] if result.metrics else {}
    print(json.dumps({"output_dir": str(result.output_dir), "final": str(result.final_dir),
                      "steps": last.get("step"), "reward/mean": last.get("reward/mean")}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"grpo {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    train = commands.add_parser(
        "train",
        help="train a model with GRPO or PPO from a YAML config",
        description=TRAIN_HELP,
        epilog=_config_reference(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("config", help="the YAML config file")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set rollout.group_size=4 (repeatable)")
    train.add_argument("--resume", action="store_true", help="continue the run in output_dir from its newest checkpoint")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.set_defaults(handler=_train)
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
