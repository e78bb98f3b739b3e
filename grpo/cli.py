"""The `grpo` command: parses arguments and dispatches; it holds no logic of its own.

Every command's settings are one typed config whose fields are declared with
`grpo.config.fields.opt` (one default and one docstring each): `grpo.config.Config` (train, read
from YAML), `SFTConfig` and `FineTuneConfig` (sft), `EvalConfig` (eval), `RewardTrainConfig`
and `RewardEvalConfig` (rm), `DemoConfig` (demo). A flag that sets a field takes its help,
default and type from the field (`grpo.cli_flags`), so each is written once, there. The configs
hold what a command makes or measures; how it runs (where the output goes, the device,
progress lines, --overwrite) are keyword arguments of the function it calls, and those
flags are written here. The prose of each command's --help is in `grpo.cli_help`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

from grpo import __version__
from grpo.cli_help import (
    COMPARE_HELP,
    DEMO_HELP,
    DESCRIPTION,
    EPILOG,
    EVAL_HELP,
    PLAN_HELP,
    PROBE_HELP,
    RM_EVAL_HELP,
    RM_HELP,
    RM_TRAIN_HELP,
    SFT_HELP,
    TRAIN_HELP,
    VLLM_SERVE_HELP,
)
from grpo.cli_flags import config_from, field_flag, field_help, fields, flag_name
from grpo.demo.default import QUICK, DemoConfig
from grpo.demo.tool_use import ToolsDemoConfig
from grpo.errors import Stopped, UserError
from grpo.eval.command import EvalConfig
from grpo.infra import allocator
from grpo.infra.argtypes import DEVICE_HELP, digit_list, fraction, positive_float, positive_int
from grpo.rewards.model import RewardEvalConfig, RewardTrainConfig
from grpo.tasks import load_task
from grpo.train.sft import FineTuneConfig, SFTConfig
from grpo.vllm.server import ServeConfig


# ---- the commands ------------------------------------------------------------------------


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
        args.output,
        config_from(RewardTrainConfig, args),
        overwrite=args.overwrite,
        progress=not args.quiet,
        log_every=args.log_every,
        device=args.device,
    )
    print(json.dumps(summary))
    return 0


def _rm_eval(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from grpo.rewards.model import evaluate_reward_model

    hf_logging.disable_progress_bar()
    print(json.dumps(evaluate_reward_model(config_from(RewardEvalConfig, args), device=args.device)))
    return 0


def _sft_config(args: argparse.Namespace) -> SFTConfig | FineTuneConfig:
    """The mode the flags ask for, as its config: --model (and --data) fine-tune, else --task
    trains from scratch; a flag of the other mode is one line."""
    fine_tune, scratch = fields(FineTuneConfig), fields(SFTConfig)
    given = {name: value for name, value in vars(args).items() if value is not None and name in {*fine_tune, *scratch}}
    flag = {"hidden_size": "--hidden"}  # the flags not named as their field is

    def wrong(names: list[str]) -> str:
        return ", ".join(flag.get(name) or flag_name(name) for name in names)

    if "model" not in given:
        if "data" in given:
            raise UserError(
                "--data needs --model, the model to fine-tune on it (without --model, sft trains "
                "the built-in --task from scratch)"
            )
        others = [name for name in given if name not in scratch]
        if others:
            raise UserError(
                f"{wrong(others)}: fine-tuning options, for --model and --data; --task trains a new model from scratch"
            )
        return SFTConfig(**given)
    if "task" in given:
        raise UserError(
            "--model and --task exclude each other: --model fine-tunes a model on --data, "
            "--task trains a new model from scratch on a built-in task"
        )
    if "data" not in given:
        raise UserError(
            "--model needs --data, the rows to fine-tune it on (a file or dataset, as grpo train's data.path)"
        )
    others = [name for name in given if name not in fine_tune]
    if others:
        raise UserError(f"{wrong(others)}: options of --task (a new model from scratch), not of --model")
    if given.get("lora_target_modules", "all-linear") != "all-linear":
        given["lora_target_modules"] = tuple(
            name.strip() for name in given["lora_target_modules"].split(",") if name.strip()
        )
    return FineTuneConfig(**given)


def _sft(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from grpo.train.sft import sft

    config = _sft_config(args)
    hf_logging.disable_progress_bar()  # our own bar shows the training
    summary = sft(
        args.output,
        config,
        progress=not args.quiet,
        overwrite=args.overwrite,
        device=args.device,
        log_every=args.log_every,
    )
    print(json.dumps(summary))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from grpo.eval.command import run

    return run(
        config_from(EvalConfig, args),
        load_task=load_task,
        device=args.device,
        out=args.out,
        plot=args.plot,
        progress=not args.quiet,
        log_every=args.log_every,
    )


def _probe(args: argparse.Namespace) -> int:
    from grpo.train.probe import command

    return command(args.config, overrides=args.set, prompts=args.prompts, threshold=args.threshold, json_path=args.json)


def _plan(args: argparse.Namespace) -> int:
    from grpo.train.advice import command

    given = {k: getattr(args, k) for k in ("memory", "device", "prompt_tokens", "completion_tokens")}
    return command(args.config, overrides=args.set, json_path=args.json, **given)


def _vllm_serve(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from grpo.vllm import missing
    from grpo.vllm.server import serve

    if missing() is not None:
        raise UserError(missing().replace("rollout.sampler: vllm", "grpo vllm-serve"))
    hf_logging.disable_progress_bar()

    def ready(address: str, info: dict) -> None:
        print(
            f"grpo vllm-serve: {info['model']} ({info['dtype']}, fingerprint {info['fingerprint']}) "
            f"answers at http://{address}",
            flush=True,
        )

    try:
        serve(config_from(ServeConfig, args), device=args.device, ready=ready)
    except KeyboardInterrupt:
        print("grpo vllm-serve: stopped", file=sys.stderr)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from grpo.demo.default import demo, quick

    hf_logging.disable_progress_bar()
    if args.tools:
        return _tools_demo(args)
    config = config_from(DemoConfig, args)
    if args.quick:  # the smoke budget; --steps still says how many steps
        config = dataclasses.replace(quick(config), steps=args.steps or QUICK["steps"])
    output = args.output or "runs/demo"
    summary = demo(output, config, progress=not args.quiet, overwrite=args.overwrite)
    print(json.dumps({"report": str(Path(output) / "report.md"), "time_s": round(summary["time_s"], 1)}))
    return 0


def _tools_demo(args: argparse.Namespace) -> int:
    """`grpo demo --tools`: the multi-turn demo (grpo.demo.tool_use); --seed, --seeds, --steps
    and --quick apply, the main demo's other flags do not."""
    from grpo.demo.tool_use import quick, tools_demo

    others = [name for name in ("full", "equal_tokens", "neural_rm") if getattr(args, name)]
    if others or args.full_seeds != DemoConfig.full_seeds:
        raise UserError(f"demo --tools: --{(others or ['full_seeds'])[0].replace('_', '-')} is the main demo's flag")
    config = ToolsDemoConfig(seed=args.seed)
    if args.quick:
        config = quick(config)
    given = {name: getattr(args, name) for name in ("seeds", "steps") if getattr(args, name) is not None}
    config = dataclasses.replace(config, **given)
    output = args.output or "runs/demo-tools"
    summary = tools_demo(output, config, progress=not args.quiet, overwrite=args.overwrite)
    print(json.dumps({"report": str(Path(output) / "report.md"), "time_s": round(summary["time_s"], 1)}))
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


# ---- the parser --------------------------------------------------------------------------


def _command(commands, name: str, help: str, description: str, **kwargs) -> argparse.ArgumentParser:
    """A subcommand whose --help prints `description` as written."""
    return commands.add_parser(
        name, help=help, description=description, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs
    )


def _device(parser) -> None:
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)


def _log_every(parser, lines: str) -> None:
    parser.add_argument(
        "--log-every",
        type=positive_int,
        default=10,
        metavar="N",
        help=f"when stderr is not a terminal (a file, a cluster's log), {lines} (default: %(default)s)",
    )


def _config_and_set(parser) -> None:
    """The arguments of a command that reads a training config: CONFIG and --set."""
    parser.add_argument("config", help="the YAML config file")
    example = "e.g. --set rollout.group_size=4"
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help=f"override a config key, {example} (repeatable)"
    )


def _add_train(commands) -> None:
    train = _command(
        commands, "train", "train a model with GRPO or PPO from a YAML config", TRAIN_HELP, epilog=_config_reference()
    )
    _config_and_set(train)
    resume = train.add_mutually_exclusive_group()
    resume.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in output_dir from its newest intact checkpoint (a folder with none starts afresh, its logged steps kept in previous/)",
    )
    resume.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in output_dir: the files an earlier run wrote there (checkpoints, logs, final/) go once the new run starts",
    )
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.set_defaults(handler=_train)


def _add_rm(commands) -> None:
    rm = _command(
        commands, "rm", "train and evaluate reward models (a scalar score per completion, from comparisons)", RM_HELP
    )
    rm.set_defaults(handler=lambda args: rm.print_help())
    rm_commands = rm.add_subparsers(title="commands", metavar="COMMAND")

    rm_train = _command(rm_commands, "train", "train a reward model from pairwise comparisons", RM_TRAIN_HELP)
    flag = functools.partial(field_flag, rm_train, RewardTrainConfig)
    flag("model", metavar="BASE")
    flag("data", metavar="PAIRS")
    rm_train.add_argument("--output", required=True, metavar="DIR", help="where to save the reward model")
    flag("lr")
    flag("epochs", type=positive_int)
    flag("batch_size", type=positive_int)
    flag("eval_fraction", type=fraction)
    flag("seed")
    flag("max_length", type=positive_int)
    _device(rm_train)
    rm_train.add_argument("--overwrite", action="store_true", help="write into a non-empty --output directory")
    rm_train.add_argument("--quiet", action="store_true", help="no progress bar, no progress lines")
    _log_every(
        rm_train,
        "one line every N batches (step, epoch, loss, accuracy, s/step) instead of a bar; the first and last always",
    )
    rm_train.set_defaults(handler=_rm_train)

    rm_eval = _command(rm_commands, "eval", "measure a reward model's accuracy on comparisons", RM_EVAL_HELP)
    field_flag(rm_eval, RewardEvalConfig, "model", metavar="DIR")
    field_flag(rm_eval, RewardEvalConfig, "data", metavar="PAIRS")
    field_flag(rm_eval, RewardEvalConfig, "batch_size", type=positive_int)
    _device(rm_eval)
    rm_eval.set_defaults(handler=_rm_eval)


def _add_eval(commands) -> None:
    parser = _command(commands, "eval", "measure pass@k and maj@k of a model (n samples per prompt)", EVAL_HELP)
    flag = functools.partial(field_flag, parser, EvalConfig)
    flag("model", metavar="DIR")
    flag("data", metavar="D")
    flag("data_config", metavar="NAME")
    flag("split", metavar="SPLIT")
    flag("system_prompt", metavar="TEXT")
    flag("n", type=positive_int)
    flag("k", metavar="K,K,...")
    check = parser.add_mutually_exclusive_group()
    field_flag(check, EvalConfig, "task", metavar="SPEC")
    field_flag(check, EvalConfig, "verifier", metavar="FN")
    answer = parser.add_mutually_exclusive_group()
    field_flag(answer, EvalConfig, "answer", metavar="FN")
    field_flag(answer, EvalConfig, "answer_pattern", metavar="REGEX")
    flag("threshold")
    flag("prompt_column")
    flag("temperature")
    flag("top_p")
    flag("draw")
    flag("max_new_tokens", type=positive_int)
    flag("batch_size", type=positive_int)
    flag("seed")
    flag("dtype")
    flag("tools", metavar="FN,FN,...")
    flag("environment", metavar="CLASS")
    flag("max_tool_calls", metavar="N")
    flag("tool_timeout", metavar="S")
    flag("tool_isolate")
    _device(parser)
    parser.add_argument("--out", default=None, metavar="FILE", help="write the full results (JSON) here")
    parser.add_argument("--plot", default=None, metavar="PNG", help="draw the pass@k and maj@k curves here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar, no progress lines")
    _log_every(
        parser,
        "one line every N prompts (completions and prompts done, running pass@1, completions/s) instead of a bar; "
        "the first and last always",
    )
    parser.set_defaults(handler=_eval)


def _add_sft(commands) -> None:
    parser = _command(
        commands,
        "sft",
        "supervised warm-up: fine-tune a model on your rows, or train a small one from scratch on arithmetic",
        SFT_HELP,
    )
    parser.add_argument("--output", required=True, metavar="DIR", help="where to save the model and tokenizer")
    _device(parser)
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty --output directory")
    _log_every(parser, "a plain line every N updates (update, loss, elapsed, s/step) instead of a bar")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no lines")

    # Every flag of a config field is left unset (None) when not given: the flags given choose
    # the mode (_sft_config), and the mode's config supplies the rest.
    def both(group, name: str, *flags: str, **kwargs) -> None:
        """A flag of either mode: its help is each mode's field doc, with each one's default."""
        parts = [
            f"with {mode}: {field_help(config, name)}"
            for mode, config in (("--model", FineTuneConfig), ("--task", SFTConfig))
            if name in fields(config)
        ]
        group.add_argument(*(flags or [flag_name(name)]), dest=name, help="; ".join(parts), **kwargs)

    modes = parser.add_argument_group("both modes")
    once = modes.add_mutually_exclusive_group()
    both(once, "steps", type=positive_int, metavar="N")
    both(once, "epochs", type=positive_int, metavar="E")
    both(modes, "batch_size", type=positive_int, metavar="B")
    both(modes, "lr", type=positive_float, metavar="X")
    both(modes, "seed", type=int, metavar="S")

    mine = parser.add_argument_group("fine-tuning your model on your rows (--model and --data)")
    flag = functools.partial(field_flag, mine, FineTuneConfig, unset=True)
    flag("model", metavar="DIR_OR_HUB_ID")
    flag("data", metavar="FILE")
    flag("prompt_column", metavar="NAME")
    flag("completion_column", metavar="NAME")
    flag("messages_column", metavar="NAME")
    flag("max_length", type=positive_int, metavar="T")
    flag("dtype")
    flag("layout")
    flag("lora_r", type=int, metavar="R")
    flag("lora_alpha", type=positive_float, metavar="A")
    flag("lora_target_modules", metavar="NAMES")
    flag("lora_save")

    scratch = parser.add_argument_group("from scratch (--task)")
    flag = functools.partial(field_flag, scratch, SFTConfig, unset=True)
    flag("task", metavar="NAME")
    flag("hidden_size", "--hidden", type=positive_int, metavar="H")
    flag("layers", type=positive_int, metavar="L")
    flag("heads", type=positive_int, metavar="A")
    flag("digits", type=digit_list, metavar="D")
    parser.set_defaults(handler=_sft)


def _add_demo(commands) -> None:
    demo = _command(
        commands, "demo", "the built-in demo: Maj@K vs Pass@K, GRPO vs PPO (minutes on a laptop CPU)", DEMO_HELP
    )
    demo.add_argument("--output", help="where the report goes (default: runs/demo; runs/demo-tools with --tools)")
    flag = functools.partial(field_flag, demo, DemoConfig)
    flag("seed")
    flag(
        "steps",
        type=positive_int,
        unset=True,
        shown=f"{DemoConfig.steps}; {QUICK['steps']} with --quick; {ToolsDemoConfig.steps} with --tools",
    )
    flag("seeds", type=positive_int, unset=True, shown=f"{DemoConfig.seeds}; {ToolsDemoConfig.seeds} with --tools")
    flag("full")
    flag("full_seeds", type=positive_int)
    flag("equal_tokens")
    flag("neural_rm")
    demo.add_argument(
        "--tools",
        action="store_true",
        help="instead, the multi-turn demo: a tiny model learns with GRPO to use a multiply(a, b) tool "
        "(base vs GRPO, with the tool and without; --output defaults to runs/demo-tools)",
    )
    demo.add_argument("--quick", action="store_true", help="a tiny budget that runs every stage: a smoke run")
    demo.add_argument("--overwrite", action="store_true", help="replace the output of an earlier demo in --output")
    demo.add_argument("--quiet", action="store_true", help="no progress output")
    demo.set_defaults(handler=_demo)


def _add_compare(commands) -> None:
    compare = _command(commands, "compare", "train two configs on the same data and budget, side by side", COMPARE_HELP)
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
        "(arithmetic, multiply, reasoning_gym) or 'pkg.module:name' naming a grpo.tasks.Task",
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
    answer = compare.add_mutually_exclusive_group()
    answer.add_argument(
        "--answer",
        default=None,
        metavar="FN",
        help="'pkg.module:fn' reading a completion's final answer (a hashable value, or None for none): "
        "the votes of maj@n (default: the task's extractor)",
    )
    field_flag(answer, EvalConfig, "answer_pattern", metavar="REGEX")  # as grpo eval reads it
    compare.add_argument("--quiet", action="store_true", help="no progress output")
    compare.set_defaults(handler=_compare)


def _add_probe(commands) -> None:
    probe = _command(commands, "probe", "before a run: what its first step learns from, what to change", PROBE_HELP)
    _config_and_set(probe)
    add = probe.add_argument
    add("--prompts", type=positive_int, metavar="N", help="prompts sampled (default: rollout.prompts_per_step)")
    add("--threshold", type=float, metavar="X", help="a pass: reward >= X (default: eval.threshold or 0.5)")
    add("--json", metavar="FILE", help="write every number and the verdict here (JSON)")
    probe.set_defaults(handler=_probe)


def _add_plan(commands) -> None:
    from grpo.train.plan import size_type

    plan = _command(
        commands, "plan", "before a run: its peak memory by phase, and what brings it under a size", PLAN_HELP
    )
    _config_and_set(plan)
    add = plan.add_argument
    add(
        "--memory",
        type=size_type,
        metavar="SIZE",
        help="the memory to fit in (e.g. 24G, 512M): a verdict and the savers that bring the peak under it",
    )
    add("--device", choices=("auto", "cpu", "cuda"), default="auto", help="plan for (default: train.device's)")
    add(
        "--prompt-tokens",
        type=positive_int,
        metavar="N",
        help="the prompts' length in tokens (default: rollout.max_prompt_length, else 256)",
    )
    add(
        "--completion-tokens",
        type=positive_int,
        metavar="N",
        help="the completions' length in the passes (default: rollout.max_new_tokens, the longest)",
    )
    add("--json", metavar="FILE", help="write every number and the verdict here (JSON)")
    plan.set_defaults(handler=_plan)


def _add_vllm_serve(commands) -> None:
    parser = _command(
        commands, "vllm-serve", "serve a vLLM engine for training runs elsewhere (rollout.vllm.server)", VLLM_SERVE_HELP
    )
    flag = functools.partial(field_flag, parser, ServeConfig)
    flag("model", metavar="DIR")
    flag("host")
    flag("port", type=int)
    flag("dtype")
    flag("max_model_len", type=positive_int, metavar="N")
    flag("max_num_seqs", type=positive_int, metavar="N")
    flag("gpu_memory_utilization", type=positive_float, metavar="F")
    flag("kv_cache_gb", type=positive_int, metavar="GB")
    flag("seed")
    _device(parser)
    parser.set_defaults(handler=_vllm_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"grpo {__version__} (memory allocator: {allocator.active()})"
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add in (
        _add_train,
        _add_probe,
        _add_plan,
        _add_rm,
        _add_eval,
        _add_sft,
        _add_demo,
        _add_compare,
        _add_vllm_serve,
    ):  # the order --help lists them in
        add(commands)
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
