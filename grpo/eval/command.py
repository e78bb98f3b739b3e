"""`grpo eval`: pass@k and maj@k of a model, with their confidence intervals, as a table and JSON.

`register(commands)` adds the subcommand to the `grpo` parser; the handler checks every
argument it can (the k list, the data, the verifier on every row, the output paths) before
the model loads, so a mistake costs a second, not an evaluation.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from grpo.errors import UserError
from grpo.infra.argtypes import positive_int

__all__ = ["ARITHMETIC_SEED", "register", "run"]

# "arithmetic:N" draws N problems with this seed: the same problems on every run, so that
# results of different models (and of one model before and after training) compare.
ARITHMETIC_SEED = 20240205

EVAL_HELP = """\
Measure pass@k and maj@k of a model (DeepSeekMath Fig. 7: RL raises Maj@K, not Pass@K).

For every prompt of --data, --n completions are sampled (temperature 0.7 by default) and each is
checked: by a built-in task (--task) or by a reward function (--verifier; correct when its
score >= --threshold). Then for every k:
  pass@k  the chance that at least one of k samples is correct (unbiased: 1 - C(n-c,k)/C(n,k))
  maj@k   the accuracy of a majority vote over the final answers of k samples
both exact expectations over the k-subsets of the n samples, averaged over prompts, with
95% normal confidence intervals over prompts (mean +- 1.96 s/sqrt(P), clipped to [0, 1]).

Prints a table, then, as the last line, a JSON summary (everything but the per-prompt
details). --out writes the full JSON (per_prompt included); --plot draws both curves.
The same --seed and --batch-size give the same samples.
"""




def register(commands) -> None:
    """Add `eval` to the subparsers object of the `grpo` parser."""
    parser = commands.add_parser(
        "eval",
        help="measure pass@k and maj@k of a model (n samples per prompt)",
        description=EVAL_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="a causal LM directory (e.g. a run's final/) or hub id")
    parser.add_argument("--data", required=True, metavar="D",
                        help="a .jsonl/.json/.parquet/.csv file, a dataset directory or name, or 'arithmetic:N' "
                             f"for N generated addition problems (seed {ARITHMETIC_SEED})")
    parser.add_argument("--n", type=positive_int, default=64, help="samples per prompt (default: %(default)s)")
    parser.add_argument("--k", default=None, metavar="K,K,...",
                        help="comma-separated k to report, each <= n (default: the powers of 2 up to n)")
    check = parser.add_mutually_exclusive_group()
    check.add_argument("--task", default=None, help="a built-in task that checks answers: arithmetic (the default)")
    check.add_argument("--verifier", default=None, metavar="FN",
                       help="a reward function as the checker: a built-in (exact_answer, math_answer, ...) or "
                            "'pkg.module:fn' with TRL's signature; answers for maj@k are read by "
                            "grpo.rewards.rules.extract_answer")
    parser.add_argument("--threshold", type=float, default=0.5,
                        help="with --verifier: a completion is correct when its score >= this (default: %(default)s)")
    parser.add_argument("--prompt-column", default="prompt", help="the data's prompt column (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64,
                        help="per completion (default: %(default)s)")
    parser.add_argument("--batch-size", type=positive_int, default=256,
                        help="completions per generate call (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the sampling (default: %(default)s)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="dtype the model is loaded in (default: %(default)s)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda when there is one)")
    parser.add_argument("--out", default=None, metavar="FILE", help="write the full results (JSON) here")
    parser.add_argument("--plot", default=None, metavar="PNG", help="draw the pass@k and maj@k curves here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run)


# ---- checking the arguments -------------------------------------------------------------


def parse_ks(text: str | None, n: int) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (sorted, unique), each in 1..n; None -> the powers of 2 up to n."""
    if text is None:
        return [2**i for i in range(n.bit_length()) if 2**i <= n]
    ks = []
    for item in text.split(","):
        item = item.strip()
        if not re.fullmatch(r"[0-9]+", item) or int(item) < 1:
            raise UserError(f"--k: expected comma-separated positive integers such as 1,2,4,8, got {text!r}")
        ks.append(int(item))
    too_big = sorted(k for k in set(ks) if k > n)
    if too_big:
        raise UserError(f"--k: k = {', '.join(map(str, too_big))} is more than --n {n} samples per prompt")
    return sorted(set(ks))


def load_data(spec: str, prompt_column: str) -> list[dict]:
    """The rows of --data: 'arithmetic:N' generates them, anything else is read by load_rows."""
    match = re.fullmatch(r"arithmetic:(.*)", spec)
    if match:
        count = match.group(1)
        if not re.fullmatch(r"[0-9]+", count) or int(count) < 1:
            raise UserError(f"--data: expected 'arithmetic:N' with N a positive integer, got {spec!r}")
        from grpo.tasks.arithmetic import make_rows

        rows = make_rows(int(count), seed=ARITHMETIC_SEED)
        if prompt_column != "prompt":
            rows = [{prompt_column: row.pop("prompt"), **row} for row in rows]
        return rows
    from grpo.data import load_rows

    try:
        return load_rows(spec, prompt_column=prompt_column)
    except UserError as err:  # load_rows speaks of the config key; here it is an option
        message = str(err)
        message = message.replace("data.prompt_column:", "--prompt-column:", 1)
        raise UserError(message.replace("data.path:", "--data:", 1)) from err


def _check_model(path: str) -> None:
    """A path that cannot be a hub id ('org/name') must be an existing directory."""
    local = Path(path).expanduser()
    if local.exists():
        if not local.is_dir():
            raise UserError(f"--model: {path!r} is a file, not a model directory")
        return
    if local.is_absolute() or path.startswith((".", "~")) or path.count("/") > 1 or "\\" in path:
        raise UserError(f"--model: no such directory {path!r}")


def _check_output(option: str, path: str | None) -> None:
    if path is not None and Path(path).is_dir():
        raise UserError(f"{option}: {path!r} is a directory; give a file name")


def _verifier(args: argparse.Namespace, rows: list[dict]):
    from grpo.eval.runner import reward_verifier, task_verifier

    if args.verifier is not None:
        verifier = reward_verifier(args.verifier, args.threshold, prompt_column=args.prompt_column)
    else:
        verifier = task_verifier(args.task or "arithmetic")
    # A dry run on empty completions: a row the verifier cannot read (no answer column, an
    # unparsable prompt) fails now, before the model loads, not after the sampling.
    for row in rows:
        verifier.check_all([""], row)
    return verifier


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device: unknown device {name!r} (cpu, cuda, cuda:N, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device: {name} asked for, but torch sees no CUDA device")
    return device


# ---- the command ------------------------------------------------------------------------


def _label(model: str) -> str:
    """The model's legend label: its directory name, with its parent's for a run's final/."""
    path = Path(model)
    if path.name in ("final", "") or path.name.startswith("checkpoint"):
        return "/".join(path.parts[-2:]) or model
    return path.name


def table(results: dict) -> str:
    """k | pass@k [95% CI] | maj@k [95% CI], one row per k."""
    lines = [f"{'k':>5}  {'pass@k':<22}  {'maj@k':<22}"]
    for k in results["pass@k"]:
        cells = []
        for metric in ("pass@k", "maj@k"):
            lo, hi = results[f"{metric}_ci"][k]
            cells.append(f"{results[metric][k]:.3f} [{lo:.3f}, {hi:.3f}]")
        lines.append(f"{k:>5}  {cells[0]:<22}  {cells[1]:<22}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """The `grpo eval` handler: check everything, load, evaluate, report. Returns 0."""
    ks = parse_ks(args.k, args.n)
    if not args.temperature > 0:
        raise UserError(f"--temperature: must be > 0 (pass@k and maj@k need sampling), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p: must be in (0, 1], got {args.top_p}")
    rows = load_data(args.data, args.prompt_column)
    verifier = _verifier(args, rows)
    _check_model(args.model)
    _check_output("--out", args.out)
    _check_output("--plot", args.plot)
    device = _device(args.device)

    from transformers.utils import logging as hf_logging

    from grpo.eval.runner import evaluate
    from grpo.train.models import load_causal_lm, load_tokenizer

    hf_logging.disable_progress_bar()  # our own bar shows the sampling
    tokenizer = load_tokenizer(args.model)
    model = load_causal_lm(args.model, args.dtype).to(device)
    results = evaluate(
        model, tokenizer, rows, n=args.n, ks=ks, verifier=verifier, prompt_column=args.prompt_column,
        temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size, seed=args.seed, progress=not args.quiet,
    )
    results = {"model": args.model, "data": args.data, **results}
    print(f"{args.model} on {args.data}: {results['prompts']} prompts x {results['n']} samples, "
          f"temperature {results['temperature']}; accuracy {results['accuracy']:.3f}, "
          f"no answer {results['no_answer']:.3f}, mean length {results['mean_length']:.1f} characters, "
          f"{results['time_s']:.1f} s")
    print(table(results))
    if args.out is not None:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
    if args.plot is not None:
        from grpo.eval.plots import plot_curves

        plot_curves({_label(args.model): results}, args.plot, title=f"{args.model} on {args.data}")
    summary = {key: value for key, value in results.items() if key != "per_prompt"}
    print(json.dumps(summary))
    return 0
