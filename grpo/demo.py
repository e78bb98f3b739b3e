"""`grpo demo`: DeepSeekMath's findings, reproduced on a laptop CPU in minutes.

1. "RL enhances Maj@K's performance but not Pass@K": RL sharpens the answers a model could
   already produce. We warm up a tiny model on addition (SFT) until it solves some problems
   sometimes, measure pass@k and maj@k for k up to 64, train it with GRPO, measure again.
   The problems mix two- and three-digit operands, so that the base misses some of them in
   all 64 tries: whether pass@64 moves is then a measurement, not a ceiling at 100%.
2. GRPO trades memory for generation: PPO holds four models (policy, reference, reward,
   value), GRPO three, but GRPO samples G completions per prompt. PPO (with its own tuned
   settings) is trained from the same base on two budgets: the same prompts as GRPO (G times
   fewer generated tokens) and the same generated tokens (G times the prompts). Each run
   trains in its own process, so that its peak memory is its own.
3. A neural reward model instead of the rule: trained on the base model's own correct and
   incorrect samples, it drives a GRPO run whose true accuracy is reported beside the reward
   it optimised, so that reward hacking would show.
4. With `full`: outcome vs process supervision (DeepSeekMath Fig. 5; the task's per-step
   verifier as the process reward) and one vs two iterations of iterative RL (Fig. 6; the
   reward model keeps learning from the policy's samples between iterations).

Every RL arm runs over `seeds` seeds (the base is one model; the seeds vary the RL runs):
summary.json gives each arm's means over seeds, each seed's numbers under `per_seed`, and
intervals over problems of the seed-averaged per-problem values.

Everything lands in `output` (default runs/demo): report.md, summary.json, plots, and each
run's own directory (config.yaml, metrics.jsonl, final/).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from grpo.config import opt
from grpo.errors import UserError
from grpo.infra.child import train_in_child
from grpo.infra.host import describe_host
from grpo.eval.report import ARM_NAMES
from grpo.tasks import arithmetic, load_task

if TYPE_CHECKING:
    from grpo.eval.runner import Verifier

# The demo's task, named as any task is: its verifier judges every evaluation and the reward
# model's comparisons. The RL runs reward it with the built-in reward `arithmetic_correct`,
# the same function as the task's verifier; the process arm with `arithmetic_steps`.
TASK = "arithmetic"


@dataclass
class DemoConfig:
    """The demo's budget. The defaults are sized for the demo's 10 minutes on a 2-core CPU;
    `full` adds the neural reward model, the supervision and the iterative-RL comparisons.
    The RL settings were chosen on problems outside the evaluation set, GRPO's and PPO's
    alike: benchmarks/README.md ("grpo demo") records what was tried and what it measured."""

    seed: int = opt(0, "The seed of every stage: the base's, and the first RL run's of each arm.")
    seeds: int = opt(5, "RL runs per arm, with seeds seed, seed + 1 and so on; 1 for a quick look.")
    digits: list[int] = opt([2, 3], "Operand lengths, mixed evenly (the base's training and every problem set).")
    sft_steps: int = opt(460, "SFT updates of the base: fewer, a weaker model; more, less left for RL to find.")
    eval_prompts: int = opt(100, "Held-out problems for pass@k and maj@k (split evenly over the digits).")
    n: int = opt(64, "Samples per problem: k goes up to n.")
    ks: list[int] = opt([1, 2, 4, 8, 16, 32, 64], "The k of pass@k and maj@k.")
    eval_temperature: float = opt(0.7, "The evaluation's sampling temperature (DeepSeekMath Fig. 7 samples at 0.7).")
    train_prompts: int = opt(8000, "The RL prompt pool (drawn with a seed apart from the evaluation set's).")
    steps: int = opt(150, "RL steps per run.")
    prompts_per_step: int = opt(32, "Prompts per step of GRPO and of PPO at equal prompts.")
    group_size: int = opt(8, "GRPO's G; PPO samples one completion per prompt.")
    temperature: float = opt(0.7, "The RL runs' sampling temperature: the evaluation's.")
    minibatches: int = opt(4, "GRPO's optimizer steps per RL step (each on a part of the step's samples).")
    max_new_tokens: int = opt(36, "Longest completion: a 3-digit solution is 32 tokens with its EOS.")
    lr: float = opt(1e-4, "GRPO's learning rate (higher ones wreck the warmed-up model).")
    warmup_steps: int = opt(10, "Learning-rate warm-up of every RL run, in optimizer steps.")
    schedule: str = opt(
        "cosine",
        "Learning-rate schedule of every RL run after its warm-up (constant, linear or cosine): a decay to 0 "
        "ends each run on a settled policy rather than on one step of a constant-rate walk.",
    )
    beta: float = opt(0.04, "KL coefficient of every RL run.")
    # PPO's own settings, tuned on problems outside the evaluation set: the policy's and the
    # critic's learning rates, GAE's lambda and the epochs over each batch. The critic starts
    # from the base (its backbone; the scalar head is new), as is usual.
    ppo_lr: float = opt(3e-5, "PPO's policy learning rate.")
    ppo_value_lr: float = opt(1e-3, "PPO's critic learning rate.")
    ppo_lam: float = opt(0.95, "PPO's GAE lambda.")
    ppo_epochs: int = opt(1, "PPO's epochs over each step's batch.")
    ppo_minibatches: int = opt(2, "PPO's optimizer steps per epoch.")
    micro_batch_size: int = opt(
        256, "Completions per pass, the same for every run, in every forward pass and in generation."
    )
    parallel: int = opt(2, "Runs trained at once, each on one thread (1: one at a time, on torch's threads).")
    neural_rm: bool = opt(
        False, "Also a GRPO run driven by a reward model trained on the base's own answers (on with `full`)."
    )
    rm_prompts: int = opt(200, "Problems the base model answers to make the reward model's comparisons.")
    rm_samples: int = opt(8, "The base's samples per such problem.")
    full: bool = opt(
        False,
        "Also outcome vs process supervision and one vs two iterations of iterative RL, one seed each (longer).",
    )


# `grpo demo --quick`: a tiny budget that runs every stage (about a minute), as a smoke run.
QUICK = dict(
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


def quick(config: DemoConfig) -> DemoConfig:
    """`config` on the QUICK budget, with at most 2 seeds."""
    return dataclasses.replace(config, **copy.deepcopy(QUICK), seeds=min(config.seeds, 2))


# The arms over seeds: name -> label (the report's names for them).
ARMS = ARM_NAMES


def _prompts_per_step(c: DemoConfig, arm: str) -> int:
    """PPO with equal generated tokens takes G times the prompts; the other arms take c's."""
    return c.prompts_per_step * (c.group_size if arm == "ppo_equal_tokens" else 1)


def _train_config(
    c: DemoConfig, output_dir: Path, base: str, data: str, arm: str, rewards: list[dict], seed: int
) -> dict:
    """The run's config: GRPO and the PPO arms differ only where the algorithms differ, in
    PPO's own settings and in the budget (PPO with equal tokens takes G times the prompts)."""
    ppo = arm.startswith("ppo")
    config = {
        "algorithm": "ppo" if ppo else "grpo",
        "model": base,
        "seed": seed,
        "output_dir": str(output_dir),
        "data": {"path": data},
        "rewards": rewards,
        "rollout": {
            "group_size": 1 if ppo else c.group_size,
            "prompts_per_step": _prompts_per_step(c, arm),
            "max_new_tokens": c.max_new_tokens,
            "temperature": c.temperature,
            "generation_batch_size": c.micro_batch_size,
        },
        "train": {
            "steps": c.steps,
            "lr": c.ppo_lr if ppo else c.lr,
            "warmup_steps": c.warmup_steps,
            "schedule": c.schedule,
            "minibatches": c.minibatches,
            "micro_batch_size": c.micro_batch_size,
            "sample_every": 50,
            "log_every": 25,
            "gradient_checkpointing": False,
        },  # a ~100k-parameter model: memory is not what binds
        "loss": {"beta": c.beta},
    }
    if ppo:
        config["train"]["epochs"] = c.ppo_epochs
        config["train"]["minibatches"] = c.ppo_minibatches
        config["loss"]["lam"] = c.ppo_lam
        config["value"] = {"lr": c.ppo_value_lr}
    return config


def _evaluate(model_dir: str, rows: list[dict], verifier: Verifier, c: DemoConfig, progress: bool) -> dict:
    from grpo.eval.runner import evaluate_saved

    return evaluate_saved(
        model_dir,
        rows,
        n=c.n,
        ks=c.ks,
        verifier=verifier,
        temperature=c.eval_temperature,
        max_new_tokens=c.max_new_tokens,
        seed=c.seed,
        progress=progress,
    )


def _comparisons_from_base(base: str, rows: list[dict], verifier: Verifier, c: DemoConfig) -> list[dict]:
    """The base model's own samples, correct (by the task's verifier) preferred over incorrect, per problem."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo.config import RolloutConfig
    from grpo.infra.hf import load_tokenizer
    from grpo.rollout import Sampler

    model = AutoModelForCausalLM.from_pretrained(base).eval()
    rollout = RolloutConfig(group_size=c.rm_samples, max_new_tokens=c.max_new_tokens, temperature=1.0)
    sampler = Sampler.from_config(load_tokenizer(base), rollout, prompt_column="prompt")
    rng = random.Random(c.seed)
    pairs = []
    with torch.random.fork_rng():
        torch.manual_seed(c.seed)
        for start in range(0, len(rows), 32):
            batch = sampler.sample(model, rows[start : start + 32])
            for g in range(0, len(batch), c.rm_samples):
                group = batch.completions[g : g + c.rm_samples]
                verdicts = verifier.check_all(group, batch.rows[g])
                right = [completion for completion, ok in zip(group, verdicts) if ok]
                wrong = [completion for completion, ok in zip(group, verdicts) if not ok]
                for chosen, rejected in list(zip(right, wrong))[:2]:
                    pairs.append({"prompt": batch.rows[g]["prompt"], "chosen": chosen, "rejected": rejected})
    rng.shuffle(pairs)
    return pairs


def _train_reward_model(c: DemoConfig, out: Path, base: str, verifier: Verifier, progress: bool) -> dict | str:
    """A reward model (the base with a scalar head) on the base's own right and wrong answers;
    its held-out numbers, or the reason it could not be trained."""
    from grpo.rewards.model import RewardModel, split_pairs

    pairs = _comparisons_from_base(
        base, arithmetic.make_rows(c.rm_prompts, seed=c.seed + 3000, digits=c.digits), verifier, c
    )
    if len(pairs) < 10:
        return f"the base model's samples gave only {len(pairs)} right/wrong pairs to learn from"
    train_pairs, held_out = split_pairs(pairs, 0.2, seed=c.seed)
    rm = RewardModel.from_base(base, seed=c.seed)
    rm.fit(train_pairs, lr=1e-3, epochs=2, batch_size=16, seed=c.seed, progress=progress)
    rm.save(out / "reward_model")
    return {"pairs": len(train_pairs), **{f"held_out_{k}": v for k, v in rm.evaluate(held_out).items()}}


def _rm_rewards(out: Path) -> list[dict]:
    return [
        {"model": str(out / "reward_model"), "weight": 1.0},
        {"function": "arithmetic_correct", "weight": 0.0},
    ]  # weight 0: watched, not trained on


@dataclass
class _Job:
    name: str  # its directory under the output: "grpo/seed-0", "grpo-rm", ...
    label: str  # for the progress line
    config: dict


def _train_all(jobs: list[_Job], out: Path, parallel: int, say) -> tuple[dict[str, dict], dict[str, str]]:
    """Train every job in its own process, `parallel` at a time (each on one thread when more
    than one); ({name: the run's summary with its metrics}, {name: why it failed}). A line per
    finished run. A failed run does not stop the others: what they measured is kept."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    threads = 1 if parallel > 1 else None

    def train(job: _Job) -> dict:
        path = out / f"{job.name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        return train_in_child(job.config, path, progress=False, threads=threads)

    done: dict[str, dict] = {}
    failed: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        futures = {pool.submit(train, job): job for job in jobs}
        for future in as_completed(futures):
            job = futures[future]
            try:
                run = done[job.name] = future.result()
            except UserError as err:
                failed[job.name] = str(err)
                say(f"      {job.label}: FAILED ({err})")
                continue
            rewards = [m["reward/mean"] for m in run["metrics"]]
            head, tail = rewards[: max(1, len(rewards) // 10)], rewards[-max(1, len(rewards) // 10) :]
            say(
                f"      {job.label}: {run['time_s']:.0f} s, mean reward {sum(head) / len(head):.3f} -> "
                f"{sum(tail) / len(tail):.3f} ({len(done) + len(failed)}/{len(jobs)})"
            )
    return done, failed


def demo(
    output: str | Path = "runs/demo",
    config: DemoConfig | None = None,
    *,
    progress: bool = True,
    overwrite: bool = False,
) -> dict:
    """Run the whole demo; return what summary.json holds. `overwrite` replaces an earlier
    demo's output (a directory holding its data/ and base/), never anything else."""
    from grpo.eval.plots import plot_curves, plot_rewards
    from grpo.eval.runner import task_verifier
    from grpo.train.sft import SFTConfig, sft

    c = config or DemoConfig()
    if c.seeds < 1:
        raise UserError(f"demo: seeds must be at least 1, got {c.seeds}")
    out = Path(output)
    if out.exists() and any(out.iterdir()):
        earlier_demo = (out / "data").is_dir() and (out / "base").is_dir()
        if not (overwrite and earlier_demo):
            hint = (
                "pass --overwrite to replace it"
                if earlier_demo
                else "it is not an earlier demo's output; choose another --output"
            )
            raise UserError(f"demo: '{out}' is not empty; {hint}")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    say = print if progress else (lambda *a, **k: None)
    stages = 5 + (1 if c.neural_rm or c.full else 0)

    task = load_task(TASK)
    verifier = task_verifier(task)
    eval_rows = arithmetic.make_rows(c.eval_prompts, seed=c.seed + 1000, digits=c.digits)
    train_rows = arithmetic.make_rows(c.train_prompts, seed=c.seed + 2000, digits=c.digits)
    data = out / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train_rows))
    (data / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in eval_rows))

    lengths = " and ".join(f"{d}-digit" for d in c.digits)
    say(f"[1/{stages}] SFT warm-up of a tiny Llama on {lengths} addition (the base model)")
    base_info = sft(out / "base", SFTConfig(seed=c.seed, steps=c.sft_steps, digits=list(c.digits)), progress=progress)
    base = str(out / "base")

    say(f"[2/{stages}] Evaluating the base model: {c.n} samples x {c.eval_prompts} problems")
    results = {"base": _evaluate(base, eval_rows, verifier, c, progress)}

    train_data, rule = str(data / "train.jsonl"), [{"function": "arithmetic_correct", "weight": 1.0}]
    jobs = []
    for arm, label in ARMS.items():
        for i in range(c.seeds):
            seed = c.seed + i
            config = _train_config(c, out / arm / f"seed-{seed}", base, train_data, arm, rule, seed)
            jobs.append(_Job(f"{arm}/seed-{seed}", f"{label}, seed {seed}", config))
    skipped_rm, rm_info = None if c.neural_rm or c.full else "not asked (--neural-rm or --full)", None
    if skipped_rm is None:  # full needs it: the first of iterative RL's two arms
        say(f"[3/{stages}] A neural reward model from the base's own samples (for GRPO driven by it alone)")
        rm_info = _train_reward_model(c, out, base, verifier, progress)
        if isinstance(rm_info, str):
            skipped_rm = rm_info
            say(f"      skipped: {rm_info}")
        else:
            jobs.append(
                _Job(
                    "grpo-rm",
                    "GRPO on the neural reward model",
                    _train_config(c, out / "grpo-rm", base, train_data, "grpo", _rm_rewards(out), c.seed),
                )
            )
    if c.full:
        process = [{"function": "arithmetic_steps", "weight": 1.0}, {"function": "arithmetic_correct", "weight": 0.0}]
        config = _train_config(c, out / "grpo-process", base, train_data, "grpo", process, c.seed)
        config["loss"]["supervision"] = "process"
        jobs.append(_Job("grpo-process", "GRPO with process supervision", config))
        if isinstance(rm_info, dict):
            config = _train_config(c, out / "grpo-rm-iterative", base, train_data, "grpo", _rm_rewards(out), c.seed)
            config["train"]["iterations"] = 2
            config["reward_model_update"] = {"verifier": "arithmetic_correct"}
            jobs.append(_Job("grpo-rm-iterative", "GRPO on the neural reward model, two iterations", config))
    # Longest first, so that two at a time finish together: PPO with equal tokens (its critic
    # and its G times the prompts), GRPO, the single runs, PPO with equal prompts.
    order = ("ppo_equal_tokens/", "grpo/", "grpo-", "ppo/")
    jobs.sort(key=lambda job: next(i for i, prefix in enumerate(order) if job.name.startswith(prefix)))
    at_once = f"{c.parallel} at a time, one thread each" if c.parallel > 1 else "one at a time"
    say(
        f"[{stages - 2}/{stages}] Training {len(jobs)} runs ({at_once}): "
        + "; ".join(
            f"{label} {c.seeds} seed(s), {c.steps} steps x {_prompts_per_step(c, arm)} prompts"
            for arm, label in ARMS.items()
        )
    )
    runs, failed = _train_all(jobs, out, c.parallel, say)
    lost = [name for name in failed if "/" in name]  # an arm's seed: the comparison cannot be made without it
    if lost:
        raise UserError(
            f"demo: {len(lost)} run(s) failed, first {lost[0]}: {failed[lost[0]]} (the other runs are in {out})"
        )

    say(f"[{stages - 1}/{stages}] Evaluating the {len(runs)} trained models")
    evaluated = {name: _evaluate(str(out / name / "final"), eval_rows, verifier, c, progress) for name in runs}
    if "grpo-rm" in runs:
        runs["grpo-rm"]["reward_model"] = rm_info
    arms = {
        arm: [
            (c.seed + i, runs[f"{arm}/seed-{c.seed + i}"], evaluated[f"{arm}/seed-{c.seed + i}"])
            for i in range(c.seeds)
        ]
        for arm in ARMS
    }
    single = {
        name: (runs[name], evaluated[name]) for name in ("grpo-rm", "grpo-process", "grpo-rm-iterative") if name in runs
    }

    say(f"[{stages}/{stages}] Writing the report")
    summary = {
        "config": asdict(c),
        "host": describe_host(),  # hosts differ in speed and in float results: say which this was
        "sft": base_info,
        "time_s": None,
        "neural_rm_skipped": skipped_rm,
        "failed": failed,
        "base": _public(results["base"], None),
    }
    summary["base"]["by_digits"] = _by_digits(results["base"], eval_rows)
    for arm, done in arms.items():
        summary[arm] = _over_seeds(done, eval_rows)
    for name, (run, result) in single.items():
        summary[name] = {**_public(result, run), "seed": c.seed}
    _plots(out, summary, plot_curves, plot_rewards)
    summary["time_s"] = time.perf_counter() - started
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    from grpo.eval.report import write_report

    write_report(out / "report.md", summary)
    say(f"Done in {summary['time_s'] / 60:.1f} min: {out / 'report.md'}")
    return summary


def _plots(out: Path, s: dict, plot_curves, plot_rewards) -> None:
    names = {"base": "base (SFT)", **ARMS, "grpo-rm": "GRPO, neural RM"}
    plot_curves(
        {label: s[key] for key, label in names.items() if key in s and key != "grpo-rm"},
        out / "pass_maj_at_k.png",
        title="Held-out addition problems (means over seeds)",
    )
    plot_rewards(
        {ARMS[arm]: list(enumerate(s[arm]["reward"], start=1)) for arm in ARMS},
        out / "rewards.png",
        ylabel="mean reward (fraction correct), mean over seeds",
    )
    if "grpo-rm" in s:
        r = s["grpo-rm"]
        plot_rewards(
            {
                "reward model's score": list(enumerate(r["rm_score"], start=1)),
                "true accuracy": list(enumerate(r["true_accuracy"], start=1)),
            },
            out / "neural_rm.png",
            ylabel="per step, during GRPO",
        )
    if "grpo-process" in s:
        plot_rewards(
            {
                "outcome supervision": list(enumerate(s["grpo"]["per_seed"][0]["true_accuracy"], start=1)),
                "process supervision": list(enumerate(s["grpo-process"]["true_accuracy"], start=1)),
            },
            out / "supervision.png",
            ylabel="true accuracy of the samples, per step",
        )
    if "grpo-rm-iterative" in s and "grpo-rm" in s:
        plot_rewards(
            {
                "one iteration": list(enumerate(s["grpo-rm"]["true_accuracy"], start=1)),
                "two iterations": list(enumerate(s["grpo-rm-iterative"]["true_accuracy"], start=1)),
            },
            out / "iterative.png",
            ylabel="true accuracy of the samples, per step",
        )


def _true_accuracy(run: dict) -> list[float]:
    key = "reward/arithmetic_correct" if "reward/arithmetic_correct" in run["metrics"][0] else "reward/mean"
    return [m[key] for m in run["metrics"]]


def _public(result: dict, run: dict | None) -> dict:
    """One model's entry in summary.json: its curves, and for trained ones what it cost."""
    entry = {
        "pass@k": result["pass@k"],
        "maj@k": result["maj@k"],
        "pass@k_ci": result["pass@k_ci"],
        "maj@k_ci": result["maj@k_ci"],
        "no_answer": result["no_answer"],
    }
    if run is not None:
        entry.update(
            {
                key: run[key]
                for key in (
                    "models",
                    "parameters",
                    "peak_memory_mb",
                    "time_s",
                    "generated_tokens",
                    "steps",
                    "prompts",
                    "time_per_step_s",
                )
            }
        )
        entry["reward"] = [m["reward/mean"] for m in run["metrics"]]
        entry["true_accuracy"] = _true_accuracy(run)
        if "reward_model" in run:
            entry["reward_model"] = run["reward_model"]
            key = next(k for k in run["metrics"][0] if k.startswith("reward/model:"))
            entry["rm_score"] = [m[key] for m in run["metrics"]]
    return entry


def _by_digits(result: dict, rows: list[dict]) -> dict:
    """pass@k and maj@k per operand length, from the per-problem values."""
    groups: dict[int, list[dict]] = {}
    for row, prompt in zip(rows, result["per_prompt"]):
        groups.setdefault(row["digits"], []).append(prompt)
    return {
        str(d): {
            metric: {k: sum(p[metric][k] for p in ps) / len(ps) for k in ps[0][metric]}
            for metric in ("pass@k", "maj@k")
        }
        for d, ps in sorted(groups.items())
    }


def _over_seeds(done: list[tuple[int, dict, dict]], rows: list[dict]) -> dict:
    """An arm's entry: each number the mean over seeds; the intervals over problems, of each
    problem's value averaged over seeds; the spread (lowest and highest seed) beside it; and
    every seed's own numbers under per_seed."""
    from grpo.eval.runner import mean_ci

    per_seed = [
        {"seed": seed, **_public(result, run), "by_digits": _by_digits(result, rows)} for seed, run, result in done
    ]
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    metrics = ("pass@k", "maj@k")
    # Each problem's values averaged over seeds: the intervals over problems and the lengths' means.
    averaged = {
        "per_prompt": [
            {
                m: {k: mean([result["per_prompt"][i][m][k] for _, _, result in done]) for k in per_seed[0][m]}
                for m in metrics
            }
            for i in range(len(rows))
        ]
    }
    entry: dict = {}
    for metric in metrics:
        ks = list(per_seed[0][metric])
        entry[metric] = {k: mean([s[metric][k] for s in per_seed]) for k in ks}
        entry[f"{metric}_range"] = {
            k: [min(s[metric][k] for s in per_seed), max(s[metric][k] for s in per_seed)] for k in ks
        }
        entry[f"{metric}_ci"] = {k: mean_ci([p[metric][k] for p in averaged["per_prompt"]])[1] for k in ks}
    for key in ("no_answer", "peak_memory_mb", "time_s", "generated_tokens", "time_per_step_s"):
        entry[key] = mean([s[key] for s in per_seed])
    for key in ("models", "parameters", "steps", "prompts"):
        entry[key] = per_seed[0][key]
    for key in ("reward", "true_accuracy"):
        entry[key] = [mean(values) for values in zip(*(s[key] for s in per_seed))]
    entry["by_digits"] = _by_digits(averaged, rows)
    entry["per_seed"] = per_seed
    return entry
