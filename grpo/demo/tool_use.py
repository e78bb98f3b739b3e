"""`grpo demo --tools`: a model learns, from the outcome reward alone, to use its tool.

On the built-in multi-turn task (`grpo.tasks.multiply`: 2-digit products, which a tiny model
cannot compute in its head, and a `multiply(a, b)` tool), a tiny Llama warmed up to call
the tool only part of the time is measured with the tool offered and without, trained with
GRPO on the task's verifier over `seeds` seeds (each run in its own process), and measured
again. The report says whether accuracy with the tool rose in every seed, and the share of
right tool calls; without the tool nothing should move (the gain is the tool's, not
arithmetic learned in the head). What it writes: docs/tools.md.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from grpo.config.fields import opt
from grpo.demo.default import Job, fresh_output, train_all
from grpo.errors import UserError
from grpo.infra.contain import run_workers
from grpo.demo.report import host_line
from grpo.infra.host import describe_host
from grpo.tasks import multiply

TOOL = "grpo.tasks.multiply:multiply"
REWARD = "grpo.tasks.multiply:correctness_reward"
USES = ("right", "wrong", "none")  # multiply.tool_use's verdicts


@dataclass
class ToolsDemoConfig:
    """The tools demo's budget; the defaults were chosen by measurement (docs/demo.md)."""

    seed: int = opt(0, "The seed of every stage: the base's, and the first GRPO run's.")
    seeds: int = opt(3, "GRPO runs, with seeds seed, seed + 1 and so on.")
    digits: int = opt(2, "Digits of each operand.")
    sft_rows: int = opt(4000, "Conversations the base is warmed up on.")
    sft_steps: int = opt(800, "SFT updates of the base (fewer: it copies the operands and results badly).")
    sft_batch_size: int = opt(32, "Conversations per SFT update.")
    sft_lr: float = opt(3e-3, "Peak SFT learning rate (a model from scratch).")
    shown_share: float = opt(0.75, "Share of the SFT conversations whose prompt shows the tool.")
    tool_share: float = opt(0.5, "Of those, the share that call it (the others answer in the head).")
    eval_prompts: int = opt(50, "Held-out problems for pass@k and maj@k.")
    n: int = opt(8, "Samples per problem: k goes up to n.")
    ks: list[int] = opt([1, 2, 4, 8], "The k of pass@k and maj@k.")
    temperature: float = opt(1.0, "Sampling temperature of training and evaluation.")
    train_prompts: int = opt(2000, "The RL prompt pool (drawn with a seed apart from the evaluation set's).")
    steps: int = opt(30, "GRPO steps per run.")
    prompts_per_step: int = opt(8, "Prompts per GRPO step.")
    group_size: int = opt(8, "GRPO's G.")
    lr: float = opt(3e-4, "GRPO's learning rate.")
    beta: float = opt(0.04, "KL coefficient.")
    max_new_tokens: int = opt(96, "Longest completion: the call, the tool's message and the answer (about 80 tokens).")
    max_tool_calls: int = opt(1, "Model turns whose calls run, per rollout (one call is all the task needs).")
    parallel: int = opt(2, "Runs trained at once, each on one thread.")


# `grpo demo --tools --quick`: every stage on a tiny budget (a smoke run; nothing is learned).
QUICK = dict(
    seeds=1,
    sft_rows=64,
    sft_steps=20,
    eval_prompts=4,
    n=4,
    ks=[1, 2, 4],
    train_prompts=16,
    steps=2,
    prompts_per_step=2,
    group_size=4,
    parallel=1,
)


def quick(config: ToolsDemoConfig) -> ToolsDemoConfig:
    return dataclasses.replace(config, **QUICK)


def _train_config(c: ToolsDemoConfig, output_dir: Path, base: str, data: str, seed: int) -> dict:
    return {
        "algorithm": "grpo",
        "model": base,
        "seed": seed,
        "output_dir": str(output_dir),
        "data": {"path": data},
        "rewards": [{"function": REWARD, "weight": 1.0}],
        "rollout": {
            "group_size": c.group_size,
            "prompts_per_step": c.prompts_per_step,
            "max_new_tokens": c.max_new_tokens,
            "temperature": c.temperature,
            "tools": [TOOL],
            "max_tool_calls": c.max_tool_calls,
        },
        "train": {
            "steps": c.steps,
            "lr": c.lr,
            "warmup_steps": min(3, c.steps),
            "micro_batch_size": c.prompts_per_step * c.group_size,
            "sample_every": 10,
            "log_every": 10,
            "gradient_checkpointing": False,
        },
        "loss": {"beta": c.beta},
    }


def evaluate_with_tools(model_dir: str | Path, rows: list[dict], c: ToolsDemoConfig, *, tools: bool) -> dict:
    """pass@k and maj@k (`grpo.eval.runner.measure`: means and 95% intervals over problems)
    of `model_dir` on `rows`, with the tool offered or not, and the share of samples that
    used it each way (`multiply.tool_use`) under "tool_use"; the per-problem values under
    "per_prompt"."""
    from transformers import AutoModelForCausalLM

    from grpo.eval.runner import measure, sample_completions, task_verifier
    from grpo.infra.hf import load_tokenizer
    from grpo.rollout.tools import Toolbox

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    toolbox = Toolbox([TOOL], max_calls=c.max_tool_calls) if tools else None
    completions = sample_completions(
        model,
        load_tokenizer(str(model_dir), "model"),
        rows,
        n=c.n,
        temperature=c.temperature,
        max_new_tokens=c.max_new_tokens,
        seed=c.seed,
        progress=False,
        tools=toolbox,
    )
    report = measure(completions, rows, ks=c.ks, verifier=task_verifier(multiply.task))
    uses = [multiply.tool_use(row["prompt"], sample) for row, group in zip(rows, completions) for sample in group]
    report["tool_use"] = {use: uses.count(use) / len(uses) for use in USES}
    return report


def _public(result: dict) -> dict:
    return {key: result[key] for key in ("pass@k", "maj@k", "pass@k_ci", "maj@k_ci", "tool_use", "no_answer")}


def _over_seeds(results: list[dict]) -> dict:
    """One arm's entry from its seeds' evaluations: each number the mean over seeds, its
    lowest and highest seed, and intervals over problems of the seed-averaged values."""
    from grpo.eval.metrics import over_seeds

    mean = lambda values: sum(values) / len(values)  # noqa: E731
    entry = over_seeds(results)
    del entry["per_prompt"]
    entry["tool_use"] = {use: mean([r["tool_use"][use] for r in results]) for use in USES}
    entry["tool_use_range"] = {
        use: [min(r["tool_use"][use] for r in results), max(r["tool_use"][use] for r in results)] for use in USES
    }
    entry["no_answer"] = mean([r["no_answer"] for r in results])
    entry["per_seed"] = [_public(r) for r in results]
    return entry


@run_workers()  # any worker it starts here stops with it (each training run, in a process of its own, stops its own)
def tools_demo(
    output: str | Path = "runs/demo-tools",
    config: ToolsDemoConfig | None = None,
    *,
    progress: bool = True,
    overwrite: bool = False,
) -> dict:
    """Run the tools demo (module doc); return what summary.json holds. `overwrite`
    replaces an earlier tools demo's output (a directory holding its data/ and base/)."""
    from grpo.train.sft import FineTuneConfig, sft

    c = config or ToolsDemoConfig()
    if c.seeds < 1:
        raise UserError(f"demo --tools: seeds must be at least 1, got {c.seeds}")
    out = fresh_output(output, overwrite, "demo --tools")
    data = out / "data"
    data.mkdir()
    started = time.perf_counter()
    say = print if progress else (lambda *a, **k: None)

    sft_rows = multiply.conversations(
        c.sft_rows, seed=c.seed, digits=c.digits, tool_share=c.tool_share, shown_share=c.shown_share
    )
    eval_rows = multiply.make_rows(c.eval_prompts, seed=c.seed + 1000, digits=c.digits)
    train_rows = multiply.make_rows(c.train_prompts, seed=c.seed + 2000, digits=c.digits)
    for name, rows in (("sft", sft_rows), ("eval", eval_rows), ("train", train_rows)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    say(
        f"[1/5] SFT warm-up of a tiny Llama on {c.sft_rows} conversations ({c.shown_share:.0%} show the tool, "
        f"{c.tool_share:.0%} of those call it)"
    )
    multiply.save_base(out / "init", seed=c.seed)
    base = out / "base"
    sft_config = FineTuneConfig(
        model=str(out / "init"),
        data=str(data / "sft.jsonl"),
        steps=c.sft_steps,
        batch_size=c.sft_batch_size,
        lr=c.sft_lr,
        warmup_steps=min(20, c.sft_steps),
        seed=c.seed,
    )
    sft(base, sft_config, progress=False, device="cpu")

    say(f"[2/5] Evaluating the base: {c.n} samples x {c.eval_prompts} problems, with the tool and without")
    base_results = {tools: evaluate_with_tools(base, eval_rows, c, tools=tools) for tools in (True, False)}

    seeds = [c.seed + i for i in range(c.seeds)]
    say(
        f"[3/5] GRPO with the tool: {len(seeds)} run(s) of {c.steps} steps x {c.prompts_per_step} prompts x G={c.group_size}"
    )
    jobs = [
        Job(
            f"grpo/seed-{seed}",
            f"GRPO, seed {seed}",
            _train_config(c, out / "grpo" / f"seed-{seed}", str(base), str(data / "train.jsonl"), seed),
        )
        for seed in seeds
    ]
    runs, failed = train_all(jobs, out, c.parallel, say)
    if failed:
        name = next(iter(failed))
        raise UserError(
            f"demo --tools: {len(failed)} run(s) failed, first {name}: {failed[name]} (the others are in {out})"
        )

    say(f"[4/5] Evaluating the {len(runs)} GRPO model(s), with the tool and without")
    trained = {
        tools: [
            evaluate_with_tools(out / "grpo" / f"seed-{seed}" / "final", eval_rows, c, tools=tools) for seed in seeds
        ]
        for tools in (True, False)
    }

    say("[5/5] Writing the report")
    summary = {
        "config": asdict(c),
        "host": describe_host(),
        "time_s": None,
        "base": {"tools": _public(base_results[True]), "no_tools": _public(base_results[False])},
        "grpo": {"tools": _over_seeds(trained[True]), "no_tools": _over_seeds(trained[False])},
        "training": {
            f"seed-{seed}": {
                "time_s": runs[f"grpo/seed-{seed}"]["time_s"],
                "reward": [m["reward/mean"] for m in runs[f"grpo/seed-{seed}"]["metrics"]],
                "calls_per_rollout": [m.get("tools/calls_per_rollout") for m in runs[f"grpo/seed-{seed}"]["metrics"]],
            }
            for seed in seeds
        },
    }
    summary["findings"] = findings(summary)
    summary["time_s"] = time.perf_counter() - started
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_report(out / "report.md", summary)
    say(f"Done in {summary['time_s'] / 60:.1f} min: {out / 'report.md'}")
    return summary


def findings(s: dict) -> dict:
    """What the numbers say: whether GRPO raised pass@1 with the tool in every seed (above the
    base), and the share of right tool calls; the mean gains with the tool and without."""
    base, grpo = s["base"], s["grpo"]
    p1 = lambda entry: entry["pass@k"]["1"]  # noqa: E731
    seeds = grpo["tools"]["per_seed"]
    return {
        "accuracy_up_with_tool_every_seed": all(p1(r) > p1(base["tools"]) for r in seeds),
        "right_calls_up_every_seed": all(r["tool_use"]["right"] > base["tools"]["tool_use"]["right"] for r in seeds),
        "pass@1_gain_with_tool": p1(grpo["tools"]) - p1(base["tools"]),
        "pass@1_gain_without_tool": p1(grpo["no_tools"]) - p1(base["no_tools"]),
        "right_calls_gain": grpo["tools"]["tool_use"]["right"] - base["tools"]["tool_use"]["right"],
    }


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _ci(interval: list[float]) -> str:
    return f"[{100 * interval[0]:.1f}-{100 * interval[1]:.1f}]"


def write_report(path: Path, s: dict) -> None:
    """report.md: the table of accuracy and tool use, base and GRPO, with the tool and without."""
    c, f = s["config"], s["findings"]
    k = str(max(c["ks"]))
    seeds = len(s["grpo"]["tools"]["per_seed"])
    lines = [
        "# A tiny model learns to use its tool: GRPO on multiplication with multiply(a, b)\n",
        f"Written by `grpo demo --tools` from what it measured ({s['time_s'] / 60:.1f} minutes on this machine"
        f"{host_line(s.get('host'))}). "
        f"{c['digits']}-digit multiplication; {c['eval_prompts']} held-out problems x {c['n']} samples at "
        f"temperature {c['temperature']}. GRPO: {seeds} seed(s), {c['steps']} steps x {c['prompts_per_step']} "
        f"prompts x G={c['group_size']}, reward: the task's verifier alone. A GRPO number is the mean over seeds "
        "(the last column gives each seed's pass@1); [low-high] are 95% intervals over problems.\n",
        f"| model | tool offered | pass@1 | maj@{k} | right calls | other calls | no call | pass@1 per seed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, label in (("base", "base (SFT)"), ("grpo", "GRPO")):
        for key, offered in (("tools", "yes"), ("no_tools", "no")):
            e = s[name][key]
            per_seed = ", ".join(_pct(r["pass@k"]["1"]) for r in e["per_seed"]) if "per_seed" in e else ""
            lines.append(
                f"| {label} | {offered} | {_pct(e['pass@k']['1'])} {_ci(e['pass@k_ci']['1'])} | "
                f"{_pct(e['maj@k'][k])} {_ci(e['maj@k_ci'][k])} | {_pct(e['tool_use']['right'])} | "
                f"{_pct(e['tool_use']['wrong'])} | {_pct(e['tool_use']['none'])} | {per_seed} |"
            )
    verdict = "in every seed" if f["accuracy_up_with_tool_every_seed"] else "not in every seed"
    with_tool, without = f["pass@1_gain_with_tool"], f["pass@1_gain_without_tool"]
    # The gain is the tool's when pass@1 without it moved by less than a tenth as much.
    whose = (
        " What RL found is the tool, not multiplication in the head."
        if with_tool > 0 and abs(without) < 0.1 * with_tool
        else ""
    )
    lines += [
        "",
        f"With the tool, GRPO moved pass@1 by {100 * with_tool:+.1f} points (above the base {verdict}) and the "
        f"share of right calls by {100 * f['right_calls_gain']:+.1f} points; without the tool, pass@1 moved by "
        f"{100 * without:+.1f} points.{whose}\n",
        "Right calls: samples that called multiply with the prompt's operands; other calls: any other call "
        "(wrong operands, a malformed call); no call: answered in the head. During training, "
        "metrics.jsonl's tools/calls_per_rollout shows the calls rising.\n",
    ]
    for name, run in s["training"].items():
        tenth = max(1, len(run["reward"]) // 10)
        first, last = (lambda xs: sum(xs[:tenth]) / tenth), (lambda xs: sum(xs[-tenth:]) / tenth)
        calls = [x or 0.0 for x in run["calls_per_rollout"]]
        lines.append(
            f"- GRPO {name}: {run['time_s']:.0f} s; over its first and last tenth of steps, mean reward "
            f"{first(run['reward']):.2f} -> {last(run['reward']):.2f}, tool calls per rollout "
            f"{first(calls):.2f} -> {last(calls):.2f}"
        )
    path.write_text("\n".join(lines) + "\n")
