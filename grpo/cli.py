"""The `grpo` command: parses arguments and dispatches; it holds no logic of its own."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from grpo import __version__
from grpo.errors import Stopped, UserError
from grpo.eval.command import add_answer_options, register as register_eval
from grpo.infra.argtypes import DEVICE_HELP, fraction, positive_int
from grpo.tasks import load_task
from grpo.train.sft import register as register_sft

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

RM_HELP = """\
Reward models: a network that gives each (prompt, completion) one scalar score, trained on
comparisons (which of two completions of a prompt is better) with the Bradley-Terry loss.

GRPO drops PPO's value model (the critic), not the reward model: the reward model is what
scores the G sampled completions whose mean becomes the baseline. Use one where no rule can
check an answer. A trained reward model is a Hugging Face directory
(AutoModelForSequenceClassification, one output) that a run's rewards can use.
"""

RM_TRAIN_HELP = """\
Train a reward model from pairwise comparisons.

PAIRS is a .jsonl, .json, .parquet or .csv file (or a `datasets` directory or name) whose
rows hold `prompt` (text, or chat messages), `chosen` (the better completion) and `rejected`
(the worse). The model is BASE (any causal LM directory or hub id) with a new one-output head
on its last token; all of it is trained to score chosen above rejected (Bradley-Terry loss).
A seeded --eval-fraction of the pairs is held out; the accuracy on them (how often chosen
scores above rejected) is reported before and after training. The last line printed is a
JSON summary: accuracy and pairs (held out), train_pairs, output, ...
"""

RM_EVAL_HELP = """\
Measure a trained reward model on comparisons: the fraction of pairs whose chosen completion
scores above the rejected one (accuracy; ties count 1/2) and the mean score difference
(margin). The last line printed is a JSON object with accuracy, margin and pairs.
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

    from grpo.infra.distributed import launched_rank
    from grpo.train import train

    hf_logging.disable_progress_bar()  # our own bar shows the run; no bars per weight file
    result = train(
        args.config, overrides=args.set, resume=args.resume, overwrite=args.overwrite, progress=not args.quiet
    )
    last = result.metrics[-1] if result.metrics else {}
    if launched_rank() == 0:  # under torchrun, process 0 speaks for all
        print(
            json.dumps(
                {
                    "output_dir": str(result.output_dir),
                    "final": str(result.final_dir),
                    "steps": last.get("step"),
                    "reward/mean": last.get("reward/mean"),
                }
            )
        )
    return 0


def _rm_train(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from grpo.rewards.model import train_reward_model

    hf_logging.disable_progress_bar()  # our own bar shows the training; no bars per weight file
    summary = train_reward_model(
        args.model,
        args.data,
        args.output,
        lr=args.lr,
        epochs=args.epochs,
        batch_size=args.batch_size,
        eval_fraction=args.eval_fraction,
        seed=args.seed,
        max_length=args.max_length,
        overwrite=args.overwrite,
        progress=not args.quiet,
        log_every=args.log_every,
        device=args.device,
    )
    print(json.dumps(summary))
    return 0


def _rm_eval(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from grpo.infra.devices import resolve_device
    from grpo.rewards.model import RewardModel, load_pairs

    hf_logging.disable_progress_bar()
    device = resolve_device(args.device, "--device")
    pairs = load_pairs(args.data)  # bad data fails before the model loads
    model = RewardModel.from_pretrained(args.model, batch_size=args.batch_size, device=device)
    print(json.dumps({**model.evaluate(pairs), "model": args.model, "data": args.data}))
    return 0


DEMO_HELP = """\
The built-in demo, on a laptop CPU, with no download (what `make demo` runs).

It warms up a tiny Llama on two- and three-digit addition until it solves some problems
sometimes (and some never, in 64 tries), measures pass@k and maj@k (k up to 64), trains it
with GRPO and, from the same base, with PPO on two budgets: the same prompts as GRPO, and
the same number of generated tokens (G times the prompts). PPO runs with its own tuned
settings (learning rates of policy and critic, GAE lambda, epochs; the critic starts from
the base). Every RL arm runs over --seeds seeds, two runs at a time on one thread each; the
report gives means, the spread over seeds and intervals over problems. It shows
DeepSeekMath's findings as measured: whether RL raises Maj@K more than Pass@K; GRPO holds
three models to PPO's four but samples G answers per question. Writes report.md,
summary.json and plots into --output (under 10 minutes on 2 cores).

--neural-rm adds a GRPO run driven by a reward model trained on the base's own right and
wrong answers, its true accuracy logged beside the score it optimised (reward hacking
shows). --full adds it and DeepSeekMath's Fig. 5 and Fig. 6 at toy scale: outcome against
process supervision (the task's per-step verifier as the reward) and one against two
iterations of iterative RL (the reward model retrained on the policy's samples between
them), one seed each, as plots and tables in the report.
"""

COMPARE_HELP = """\
Train two configs on the same data and budget and put them side by side: models and
parameters held, peak memory, generated tokens, time per step, final reward and (with
--task) accuracy (pass@1) and maj@n over --n samples per problem, measured as `grpo eval`
measures them. The second config takes the first one's data, seed, steps, prompts per step
and completion length. Writes compare.md and compare.json into --output.

--task is a built-in task (arithmetic) or any task as 'pkg.module:name': a grpo.tasks.Task,
or a function of no arguments that returns one. Its verifier checks the answers; its rows
function gives the problems unless --eval-data does. Its answer extractor reads the final
answers that maj@n votes with, unless --answer or --answer-pattern says how; when most
samples have no answer, a warning line says so (and compare.md repeats it).
"""


def _demo(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from grpo.demo import DemoConfig, demo

    hf_logging.disable_progress_bar()
    config = DemoConfig(seed=args.seed, seeds=args.seeds, neural_rm=args.neural_rm, full=args.full)
    if args.quick:  # a smoke run of every stage, in about a minute
        config = DemoConfig(
            seed=args.seed,
            seeds=min(args.seeds, 2),
            neural_rm=args.neural_rm,
            full=args.full,
            sft_steps=300,
            eval_prompts=12,
            n=8,
            ks=[1, 2, 4, 8],
            train_prompts=64,
            steps=4,
            prompts_per_step=4,
            group_size=4,
            rm_prompts=16,
        )
    if args.steps:
        config.steps = args.steps
    summary = demo(args.output, config, progress=not args.quiet, overwrite=args.overwrite)
    print(json.dumps({"report": str(Path(args.output) / "report.md"), "time_s": round(summary["time_s"], 1)}))
    return 0


def _compare(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from grpo.compare import compare

    hf_logging.disable_progress_bar()
    summary = compare(
        args.config_a,
        args.config_b,
        args.output,
        overrides=args.set,
        task=args.task,
        eval_data=args.eval_data,
        n=args.n,
        answer=args.answer,
        answer_pattern=args.answer_pattern,
        progress=not args.quiet,
    )
    if summary["aligned"]:
        print("B took A's data and budget: " + "; ".join(summary["aligned"]))
    print(summary["table"])
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
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set rollout.group_size=4 (repeatable)",
    )
    resume = train.add_mutually_exclusive_group()
    resume.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in output_dir from its newest intact checkpoint (a folder with no completed step starts afresh)",
    )
    resume.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in output_dir: remove the files an earlier run wrote there (checkpoints, logs, final/)",
    )
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.set_defaults(handler=_train)

    rm = commands.add_parser(
        "rm",
        help="train and evaluate reward models (a scalar score per completion, from comparisons)",
        description=RM_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rm.set_defaults(handler=lambda args: rm.print_help())
    rm_commands = rm.add_subparsers(title="commands", metavar="COMMAND")

    rm_train = rm_commands.add_parser(
        "train",
        help="train a reward model from pairwise comparisons",
        description=RM_TRAIN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rm_train.add_argument(
        "--model", required=True, metavar="BASE", help="the causal LM to start from (directory or hub id)"
    )
    rm_train.add_argument(
        "--data", required=True, metavar="PAIRS", help="comparisons: rows of prompt, chosen, rejected"
    )
    rm_train.add_argument("--output", required=True, metavar="DIR", help="where to save the reward model")
    rm_train.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default: %(default)s)")
    rm_train.add_argument("--epochs", type=positive_int, default=1, help="passes over the pairs (default: %(default)s)")
    rm_train.add_argument("--batch-size", type=positive_int, default=16, help="pairs per update (default: %(default)s)")
    rm_train.add_argument(
        "--eval-fraction",
        type=fraction,
        default=0.1,
        help="fraction of the pairs held out to measure accuracy (default: %(default)s)",
    )
    rm_train.add_argument(
        "--seed", type=int, default=0, help="seeds the new head, the split and the order (default: %(default)s)"
    )
    rm_train.add_argument(
        "--max-length",
        type=positive_int,
        default=None,
        help="tokens per text; longer texts lose their beginning (default: the model's limit)",
    )
    rm_train.add_argument("--device", default="auto", help=DEVICE_HELP)
    rm_train.add_argument("--overwrite", action="store_true", help="write into a non-empty --output directory")
    rm_train.add_argument("--quiet", action="store_true", help="no progress bar, no progress lines")
    rm_train.add_argument(
        "--log-every",
        type=positive_int,
        default=10,
        metavar="N",
        help="when stderr is not a terminal (a file, a cluster's log), one line every N batches "
        "(step, epoch, loss, accuracy, s/step) instead of a bar; the first and last always "
        "(default: %(default)s)",
    )
    rm_train.set_defaults(handler=_rm_train)

    rm_eval = rm_commands.add_parser(
        "eval",
        help="measure a reward model's accuracy on comparisons",
        description=RM_EVAL_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rm_eval.add_argument("--model", required=True, metavar="DIR", help="a reward model saved by `grpo rm train`")
    rm_eval.add_argument("--data", required=True, metavar="PAIRS", help="comparisons: rows of prompt, chosen, rejected")
    rm_eval.add_argument(
        "--batch-size", type=positive_int, default=32, help="texts per forward pass (default: %(default)s)"
    )
    rm_eval.add_argument("--device", default="auto", help=DEVICE_HELP)
    rm_eval.set_defaults(handler=_rm_eval)

    register_eval(commands, load_task=load_task)
    register_sft(commands)

    demo = commands.add_parser(
        "demo",
        help="the built-in demo: Maj@K vs Pass@K, GRPO vs PPO (under 10 minutes)",
        description=DEMO_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--output", default="runs/demo", help="where the report goes (default: %(default)s)")
    demo.add_argument("--seed", type=int, default=0, help="seed of every stage (default: %(default)s)")
    demo.add_argument("--steps", type=positive_int, default=None, help="RL steps per run (default: the demo's)")
    demo.add_argument(
        "--seeds",
        type=positive_int,
        default=3,
        help="RL runs per arm, seeds --seed, --seed + 1, ... (default: %(default)s; 1 for a quick look)",
    )
    demo.add_argument(
        "--full",
        action="store_true",
        help="also outcome vs process supervision and one vs two iterations of iterative RL (longer)",
    )
    demo.add_argument(
        "--neural-rm",
        action="store_true",
        help="also a GRPO run driven by a reward model trained on the base's own answers (on with --full)",
    )
    demo.add_argument("--quick", action="store_true", help="a tiny budget that runs every stage in about a minute")
    demo.add_argument("--overwrite", action="store_true", help="replace the output of an earlier demo in --output")
    demo.add_argument("--quiet", action="store_true", help="no progress output")
    demo.set_defaults(handler=_demo)

    compare = commands.add_parser(
        "compare",
        help="train two configs on the same data and budget, side by side",
        description=COMPARE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compare.add_argument("config_a", help="the first YAML config (its data and budget are used for both)")
    compare.add_argument("config_b", help="the second YAML config")
    compare.add_argument(
        "--output", default="runs/compare", help="where both runs and the table go (default: %(default)s)"
    )
    compare.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a key in both configs"
    )
    compare.add_argument(
        "--task",
        default=None,
        metavar="SPEC",
        help="measure accuracy (pass@1) and maj@n with this task's verifier: a built-in name "
        "(arithmetic, reasoning_gym) or 'pkg.module:name' naming a grpo.tasks.Task",
    )
    compare.add_argument(
        "--eval-data",
        default=None,
        help="problems for the accuracy: a data file or dataset, or 'reasoning_gym:NAME?size=N&seed=S' "
        "with --task reasoning_gym (default: 100 rows generated by the task)",
    )
    compare.add_argument(
        "--n", type=positive_int, default=8, help="samples per problem for pass@1 and maj@n (default: %(default)s)"
    )
    add_answer_options(compare, votes="maj@n", default="the task's extractor")
    compare.add_argument("--quiet", action="store_true", help="no progress output")
    compare.set_defaults(handler=_compare)
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
        from grpo.infra.distributed import launched_rank

        if launched_rank() == 0:  # under torchrun every process stops; process 0 says why
            print(f"grpo: error: {err}", file=sys.stderr)
        else:
            # torchrun stops every process once one exits: the others give process 0 time
            # to print the reason first (it exits at once; they are stopped meanwhile).
            time.sleep(10)
        return 2
    except Stopped as stop:
        from grpo.infra.distributed import launched_rank

        if launched_rank() == 0:
            print(f"grpo: {stop}", file=sys.stderr)
        return stop.code
    except KeyboardInterrupt:
        print("grpo: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
