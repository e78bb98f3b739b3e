"""`grpo demo`: DeepSeekMath's two findings, reproduced on a laptop CPU in minutes.

1. "RL enhances Maj@K's performance but not Pass@K": RL sharpens the answers a model could
   already produce. We warm up a tiny model on addition (SFT) until it solves some problems
   sometimes, measure pass@k and maj@k for k up to 64, train it with GRPO, measure again.
2. GRPO trades memory for generation: PPO holds four models (policy, reference, reward,
   value), GRPO three, but GRPO samples G completions per prompt. The same base is trained
   with PPO on the same prompts, each run in its own process so that its peak memory is
   its own, and both are measured.
3. A neural reward model instead of the rule: trained on the base model's own correct and
   incorrect samples, it drives a GRPO run whose true accuracy is reported beside the reward
   it optimised, so that reward hacking would show.

Everything lands in `output` (default runs/demo): report.md, summary.json, plots, and each
run's own directory (config.yaml, metrics.jsonl, final/).
"""

from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from grpo.errors import UserError
from grpo.infra.child import train_in_child
from grpo.tasks import Task, load_task

if TYPE_CHECKING:
    from grpo.eval.runner import Verifier

# The demo's task, named as any task is: its rows are the problems, its verifier the judge of
# every evaluation and of the reward model's comparisons. The RL runs reward it with the
# built-in reward `arithmetic_correct`, the same function as the task's verifier.
TASK = "arithmetic"


@dataclass
class DemoConfig:
    """The demo's budget. The defaults fit in 15 minutes on a 2-core CPU."""

    seed: int = 0
    sft_steps: int | None = None  # None: grpo.train.sft's default
    eval_prompts: int = 100  # held-out problems for pass@k / maj@k
    n: int = 64  # samples per problem: k goes up to n
    ks: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    eval_temperature: float = 0.7  # DeepSeekMath Fig. 7 samples at 0.7
    train_prompts: int = 2000  # the RL prompt pool (disjoint seed from the eval set)
    steps: int = 400
    prompts_per_step: int = 32  # the same for GRPO and PPO: the same budget of prompts
    group_size: int = 16  # GRPO's G; PPO samples one completion per prompt
    max_new_tokens: int = 32
    lr: float = 1e-4  # 3e-4 and above wreck the warmed-up model within a few steps (measured)
    warmup_steps: int = 20
    beta: float = 0.04
    micro_batch_size: int = 32  # the same for both, in every forward pass and in generation:
    # activation memory is then alike, and what differs is what each run holds
    neural_rm: bool = True
    rm_prompts: int = 200  # problems the base model answers to make the reward model's comparisons
    rm_samples: int = 8


def _train_config(c: DemoConfig, output_dir: Path, base: str, data: str, algorithm: str, rewards: list[dict]) -> dict:
    """GRPO and PPO configs differ only where the algorithms differ (and in the group size)."""
    return {
        "algorithm": algorithm,
        "model": base,
        "seed": c.seed,
        "output_dir": str(output_dir),
        "data": {"path": data},
        "rewards": rewards,
        "rollout": {
            "group_size": c.group_size if algorithm == "grpo" else 1,
            "prompts_per_step": c.prompts_per_step,
            "max_new_tokens": c.max_new_tokens,
            "temperature": 1.0,
            "generation_batch_size": c.micro_batch_size,
        },
        "train": {"steps": c.steps, "lr": c.lr, "warmup_steps": c.warmup_steps,
                  "micro_batch_size": c.micro_batch_size, "sample_every": 50},
        "loss": {"beta": c.beta},
    }


def _evaluate(model_dir: str, rows: list[dict], verifier: Verifier, c: DemoConfig, progress: bool) -> dict:
    from grpo.eval.runner import evaluate_saved

    return evaluate_saved(model_dir, rows, n=c.n, ks=c.ks, verifier=verifier,
                          temperature=c.eval_temperature, max_new_tokens=c.max_new_tokens, seed=c.seed,
                          progress=progress)


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


def _neural_rm_stage(c: DemoConfig, out: Path, base: str, data: str, eval_rows: list[dict], task: Task,
                     verifier: Verifier, progress: bool):
    """Train a reward model on the base's own right and wrong answers, then GRPO on its score
    alone. Returns (run, evaluation), or the reason it could not run."""
    from grpo.rewards.model import RewardModel, split_pairs

    pairs = _comparisons_from_base(base, task.make_rows(c.rm_prompts, seed=c.seed + 3000), verifier, c)
    if len(pairs) < 10:
        return f"the base model's samples gave only {len(pairs)} right/wrong pairs to learn from"
    train_pairs, held_out = split_pairs(pairs, 0.2, seed=c.seed)
    rm = RewardModel.from_base(base, seed=c.seed)
    rm.fit(train_pairs, lr=1e-3, epochs=2, batch_size=16, seed=c.seed, progress=progress)
    rm_eval = rm.evaluate(held_out)
    rm.save(out / "reward_model")
    rewards = [{"model": str(out / "reward_model"), "weight": 1.0},
               {"function": "arithmetic_correct", "weight": 0.0}]  # weight 0: watched, not trained on
    run = train_in_child(_train_config(c, out / "grpo-rm", base, data, "grpo", rewards), out / "grpo-rm.yaml",
                         progress=progress)
    run["reward_model"] = {"pairs": len(train_pairs), **{f"held_out_{k}": v for k, v in rm_eval.items()}}
    return run, _evaluate(str(out / "grpo-rm" / "final"), eval_rows, verifier, c, progress)


def demo(output: str | Path = "runs/demo", config: DemoConfig | None = None, *, progress: bool = True,
         overwrite: bool = False) -> dict:
    """Run the whole demo; return what summary.json holds. `overwrite` replaces an earlier
    demo's output (a directory holding its data/ and base/), never anything else."""
    from grpo.eval.plots import plot_curves, plot_rewards
    from grpo.eval.runner import task_verifier
    from grpo.train.sft import SFTConfig, sft

    c = config or DemoConfig()
    out = Path(output)
    if out.exists() and any(out.iterdir()):
        earlier_demo = (out / "data").is_dir() and (out / "base").is_dir()
        if not (overwrite and earlier_demo):
            hint = "pass --overwrite to replace it" if earlier_demo else "it is not an earlier demo's output; choose another --output"
            raise UserError(f"demo: '{out}' is not empty; {hint}")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    say = print if progress else (lambda *a, **k: None)

    task = load_task(TASK)
    verifier = task_verifier(task)
    eval_rows = task.make_rows(c.eval_prompts, seed=c.seed + 1000)
    train_rows = task.make_rows(c.train_prompts, seed=c.seed + 2000)
    data = out / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train_rows))
    (data / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in eval_rows))

    say("[1/6] SFT warm-up of a tiny Llama on addition (the base model)")
    sft_config = SFTConfig(seed=c.seed) if c.sft_steps is None else SFTConfig(seed=c.seed, steps=c.sft_steps)
    base_info = sft(out / "base", sft_config, progress=progress)
    base = str(out / "base")

    say(f"[2/6] Evaluating the base model: {c.n} samples x {c.eval_prompts} problems")
    results = {"base": _evaluate(base, eval_rows, verifier, c, progress)}

    rule = [{"function": "arithmetic_correct", "weight": 1.0}]
    runs = {}
    for index, algorithm in ((3, "grpo"), (4, "ppo")):
        say(f"[{index}/6] Training the base with {algorithm.upper()} ({c.steps} steps x {c.prompts_per_step} prompts)")
        cfg = _train_config(c, out / algorithm, base, str(data / "train.jsonl"), algorithm, rule)
        runs[algorithm] = train_in_child(cfg, out / f"{algorithm}.yaml", progress=progress)
        results[algorithm] = _evaluate(str(out / algorithm / "final"), eval_rows, verifier, c, progress)

    skipped_rm = None if c.neural_rm else "--no-neural-rm"
    if c.neural_rm:
        say("[5/6] A neural reward model from the base's own samples, then GRPO driven by it alone")
        stage = _neural_rm_stage(c, out, base, str(data / "train.jsonl"), eval_rows, task, verifier, progress)
        if isinstance(stage, str):
            skipped_rm = stage
            say(f"      skipped: {stage}")
        else:
            runs["grpo-rm"], results["grpo-rm"] = stage

    say("[6/6] Writing the report")
    names = {"base": "base (SFT)", "grpo": "GRPO", "ppo": "PPO", "grpo-rm": "GRPO, neural RM"}
    plot_curves({names[k]: v for k, v in results.items()}, out / "pass_maj_at_k.png",
                title="Two-digit addition, held-out problems")
    series = {names[k]: [(m["step"], m["reward/mean"]) for m in r["metrics"]] for k, r in runs.items() if k != "grpo-rm"}
    plot_rewards(series, out / "rewards.png", ylabel="mean reward (fraction correct)")
    if "grpo-rm" in runs:
        rm_metrics = runs["grpo-rm"]["metrics"]
        rm_key = next(k for k in rm_metrics[0] if k.startswith("reward/model:"))
        plot_rewards({"reward model's score": [(m["step"], m[rm_key]) for m in rm_metrics],
                      "true accuracy": [(m["step"], m["reward/arithmetic_correct"]) for m in rm_metrics]},
                     out / "neural_rm.png", ylabel="per step, during GRPO")

    summary = {
        "config": asdict(c),
        "sft": base_info,
        "time_s": None,
        "neural_rm_skipped": skipped_rm,
        **{name: _public(results[name], runs.get(name)) for name in results},
    }
    summary["time_s"] = time.perf_counter() - started
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    from grpo.eval.report import write_report

    write_report(out / "report.md", summary)
    say(f"Done in {summary['time_s'] / 60:.1f} min: {out / 'report.md'}")
    return summary


def _public(result: dict, run: dict | None) -> dict:
    """One model's entry in summary.json: its curves, and for trained ones what it cost."""
    entry = {"pass@k": result["pass@k"], "maj@k": result["maj@k"], "pass@k_ci": result["pass@k_ci"],
             "maj@k_ci": result["maj@k_ci"], "no_answer": result["no_answer"]}
    if run is not None:
        entry.update({key: run[key] for key in ("models", "parameters", "peak_memory_mb", "time_s",
                                                 "generated_tokens", "steps", "prompts", "time_per_step_s")})
        entry["reward"] = [m["reward/mean"] for m in run["metrics"]]
        if "reward_model" in run:
            entry["reward_model"] = run["reward_model"]
            key = next(k for k in run["metrics"][0] if k.startswith("reward/model:"))
            entry["rm_score"] = [m[key] for m in run["metrics"]]
            entry["true_accuracy"] = [m["reward/arithmetic_correct"] for m in run["metrics"]]
    return entry
