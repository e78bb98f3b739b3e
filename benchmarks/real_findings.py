"""The seed's findings on a real model (issue 40): does RL raise Maj@K and not Pass@K on
SmolLM2-135M-Instruct, and what does PPO's value model cost there.

    .venv/bin/python benchmarks/real_findings.py [--out runs/real-findings] [--overwrite] [--seeds 3] [--steps 40]
        [--n 64] [--held-out 40] [--max-new-tokens 256] [--train-max-new-tokens 48]
        [--warmup-format] [--parallel 1] [--model DIR] [--skip-ppo]

After `make smollm2`, on the README walkthrough's task (examples/smollm2/tasks.py: chat
prompts of one- and two-digit arithmetic, the reward the last integer written):

1. the base model is evaluated on held-out questions (none of them in the training rows):
   `--n` samples each at temperature 0.7, pass@k and maj@k for k = 1, 2, 4, ... n with 95%
   intervals over questions, at a budget (`--max-new-tokens`) meant to cut almost none of
   the base's answers; the share it does cut is printed and kept ("truncated");
2. GRPO (`--seeds` runs, the walkthrough's settings: 4 prompts x G=8 a step, lr 1e-5, beta
   0.04, `--train-max-new-tokens` a completion) and PPO (a value model initialised from the
   policy, its gradients and optimizer state held) at equal prompts (4 a step) and at equal
   generated tokens (32 prompts a step);
3. every final model evaluated as the base was. The curves of DeepSeekMath's Fig. 7 (pass@k
   and maj@k against k, base and RL) go to fig7.png, the table and what held to report.md,
   every number to summary.json: per arm its curves, the truncated share, and per run its
   peak memory, the models it held and the tokens it generated.

`--warmup-format` first fine-tunes the base (`grpo sft`) on training questions answered with
the number alone, the format the reward reads, so that RL starts from a model that already
answers in it: what is left for RL is then not the format. `--model` takes another model
(the tests run a tiny one). Wall time per stage is printed and kept; run it on an idle
machine (it takes on the order of an hour on 2 CPU cores: see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

ANSWER = r"(-?\d+)"  # the reward reads the last integer a completion writes
REWARD = "examples.smollm2.tasks:final_number"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/real-findings", help="output directory (default runs/real-findings)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier run's output in --out")
    parser.add_argument("--model", default=None, help="the base model (default: SmolLM2-135M-Instruct, `make smollm2`)")
    parser.add_argument("--seeds", type=int, default=3, help="GRPO runs, seeds 0..N-1 (default 3)")
    parser.add_argument("--steps", type=int, default=40, help="RL steps of every run (default 40)")
    parser.add_argument("--n", type=int, default=64, help="samples per held-out question (default 64)")
    parser.add_argument("--held-out", type=int, default=40, help="held-out questions evaluated (default 40)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=256, help="the evaluations' budget per sample (default 256)"
    )
    parser.add_argument(
        "--train-max-new-tokens", type=int, default=48, help="the training rollouts' budget (default 48)"
    )
    parser.add_argument("--group-size", type=int, default=8, help="GRPO's G (default 8)")
    parser.add_argument("--prompts-per-step", type=int, default=4, help="prompts a GRPO step (default 4)")
    parser.add_argument("--warmup-format", action="store_true", help="SFT on the answer format before RL")
    parser.add_argument("--warmup-steps", type=int, default=60, help="updates of --warmup-format (default 60)")
    parser.add_argument("--skip-ppo", action="store_true", help="GRPO only")
    parser.add_argument("--parallel", type=int, default=1, help="training runs at a time (one thread each if > 1)")
    parser.add_argument(
        "--batch-size", type=int, default=256, help="samples per sampling call in the evaluations (default 256)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


def powers_of_two(n: int) -> list[int]:
    return [2**i for i in range(n.bit_length()) if 2**i <= n]


def host() -> dict:
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return {"vector": "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "other"}


def held_out_rows(tasks, train_rows: list[dict], count: int) -> list[dict]:
    """`count` questions drawn as the walkthrough's held-out ones, each asked once and none of
    them a training question (the 1,000 training rows hold most of the 128 one-digit
    questions, so what is held out is mostly two-digit sums: `kinds` in summary.json)."""
    seen = {json.dumps(r["prompt"]) for r in train_rows}
    out = []
    for row in tasks.rows(100 * count + 1000, tasks.HELD_OUT_SEED):
        key = json.dumps(row["prompt"])
        if key not in seen:
            seen.add(key)
            out.append(row)
            if len(out) == count:
                break
    return out


def train_config(a: argparse.Namespace, base: str, data: str, output_dir: Path, arm: str, seed: int) -> dict:
    """One run's config: the walkthrough's GRPO; PPO the same but one sample a prompt and its
    value model (initialised from the policy, PPO's default), at 4 prompts a step (equal
    prompts) or G times that (equal generated tokens)."""
    ppo = arm.startswith("ppo")
    prompts = a.prompts_per_step * (a.group_size if arm == "ppo_equal_tokens" else 1)
    return {
        "algorithm": "ppo" if ppo else "grpo",
        "model": base,
        "seed": seed,
        "output_dir": str(output_dir),
        "data": {"path": data},
        "rewards": [{"function": REWARD}],
        "rollout": {
            "group_size": 1 if ppo else a.group_size,
            "prompts_per_step": prompts,
            "max_new_tokens": a.train_max_new_tokens,
            "temperature": 0.7,
        },
        "train": {"steps": a.steps, "lr": 1.0e-5, "log_every": 10},
        "loss": {"beta": 0.04},
    }


def evaluate(model_dir: str, rows: list[dict], a: argparse.Namespace) -> dict:
    from grpo.eval.command import pattern_extractor
    from grpo.eval.runner import evaluate_saved, reward_verifier

    verifier = reward_verifier(REWARD, extract=pattern_extractor(ANSWER))
    return evaluate_saved(
        model_dir,
        rows,
        n=a.n,
        ks=powers_of_two(a.n),
        verifier=verifier,
        temperature=0.7,
        max_new_tokens=a.max_new_tokens,
        batch_size=a.batch_size,
        seed=0,
        progress=not a.quiet,
    )


def format_warmup(base: str, out: Path, rows: list[dict], a: argparse.Namespace) -> str:
    """`grpo sft` of the base on training questions answered with the number alone."""
    from grpo.train.sft import FineTuneConfig, sft

    data = out / "data" / "format.jsonl"
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["answer"]}) + "\n" for r in rows))
    config = FineTuneConfig(model=base, data=str(data), steps=a.warmup_steps, batch_size=8, lr=1e-5, seed=0)
    sft(out / "warm", config, progress=not a.quiet, device="cpu")
    return str(out / "warm")


def curves(result: dict) -> dict:
    """What the report and the plot read of one evaluation (or of seeds averaged)."""
    keys = ("pass@k", "maj@k", "pass@k_ci", "maj@k_ci", "pass@k_range", "maj@k_range", "truncated", "mean_tokens")
    return {key: result[key] for key in keys if key in result}


def run_costs(run: dict) -> dict:
    """What a training run cost and held: its summary.json's numbers, and its reward curve."""
    rewards = [m["reward/mean"] for m in run["metrics"]]
    tenth = max(1, len(rewards) // 10)
    return {
        "peak_memory_mb": run["peak_memory_mb"],
        "models": run["models"],
        "generated_tokens": run["generated_tokens"],
        "time_s": run["time_s"],
        "reward_first_tenth": sum(rewards[:tenth]) / tenth,
        "reward_last_tenth": sum(rewards[-tenth:]) / tenth,
    }


def findings(s: dict) -> list[str]:
    """What the numbers say, in words: did RL move maj@K and pass@K at the largest k, each
    against the base, with the seeds' range beside the mean."""
    base, grpo = s["arms"]["base"], s["arms"]["grpo"]
    k_max = str(max(int(k) for k in base["pass@k"]))
    lines = []
    for metric in ("pass@k", "maj@k"):
        before, after = base[metric][k_max], grpo[metric][k_max]
        low, high = grpo.get(f"{metric}_range", {}).get(k_max, [after, after])
        name = metric.replace("@k", f"@{k_max}")
        lines.append(
            f"{name}: base {before:.1%}, GRPO {after:.1%} (seeds {low:.1%}-{high:.1%}), "
            + (
                f"{'up' if after > before else 'down'} {abs(after - before) * 100:.1f} points"
                if after != before
                else "unchanged"
            )
        )
    lines.append(f"pass@1: base {base['pass@k']['1']:.1%}, GRPO {grpo['pass@k']['1']:.1%}")
    lines.append(
        f"cut at {s['settings']['max_new_tokens']} tokens: base {base['truncated']:.1%}, GRPO {grpo['truncated']:.1%}"
    )
    for arm, label in (("ppo_equal_prompts", "equal prompts"), ("ppo_equal_tokens", "equal generated tokens")):
        if arm in s["arms"]:
            ppo, cost = s["arms"][arm], s["arms"][arm]["cost"]
            lines.append(
                f"PPO at {label}: pass@1 {ppo['pass@k']['1']:.1%}, maj@{k_max} {ppo['maj@k'][k_max]:.1%}; peak "
                f"{cost['peak_memory_mb']:.0f} MB against GRPO's {grpo['cost']['peak_memory_mb']:.0f}, "
                f"{cost['models']} models held against {grpo['cost']['models']}, {cost['generated_tokens']:.0f} "
                f"tokens generated against {grpo['cost']['generated_tokens']:.0f}"
            )
    return lines


def write_report(out: Path, s: dict) -> None:
    ks = [str(k) for k in powers_of_two(s["settings"]["n"])]
    mid = ks[len(ks) // 2]
    lines = [
        "# The seed's findings on a real model",
        "",
        f"Model: {s['settings']['model']}; host: {s['host']['vector']}; wall time {s['time_s'] / 60:.1f} min "
        f"({', '.join(f'{k} {v / 60:.1f}' for k, v in s['stage_time_s'].items())} min).",
        "",
        f"| model | pass@1 | maj@{mid} | maj@{ks[-1]} | pass@{mid} | pass@{ks[-1]} | cut at the budget | peak MB | models | "
        "generated tokens |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, arm in s["arms"].items():
        cost = arm.get("cost", {})
        lines.append(
            f"| {name} | {arm['pass@k']['1']:.1%} | {arm['maj@k'][mid]:.1%} | {arm['maj@k'][ks[-1]]:.1%} | "
            f"{arm['pass@k'][mid]:.1%} | {arm['pass@k'][ks[-1]]:.1%} | {arm['truncated']:.1%} | "
            f"{round(cost['peak_memory_mb']) if cost else '-'} | {cost.get('models', '-')} | "
            f"{round(cost['generated_tokens']) if cost else '-'} |"
        )
    lines += ["", "![pass@k and maj@k against k](fig7.png)", "", *[f"- {line}" for line in s["findings"]], ""]
    (out / "report.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    from examples.smollm2 import tasks
    from grpo.demo.default import Job, train_all
    from grpo.eval.metrics import over_seeds
    from grpo.eval.plots import plot_curves

    started = time.perf_counter()
    say = print
    base = (
        a.model
        or subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "smollm2.py")], capture_output=True, text=True, check=True
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    out = Path(a.out)
    if out.exists() and any(out.iterdir()):
        if not (a.overwrite and (out / "data").is_dir()):
            print(f"real_findings: '{out}' is not empty; pass --overwrite to replace an earlier run's output")
            return 2
        shutil.rmtree(out)
    (out / "data").mkdir(parents=True, exist_ok=True)
    train_rows = tasks.rows(tasks.TRAIN_ROWS, tasks.TRAIN_SEED)
    held_out = held_out_rows(tasks, train_rows, a.held_out)
    kinds = {name: sum(tasks.kind(r["prompt"]) == name for r in held_out) for name in tasks.KINDS}
    data = out / "data" / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in train_rows))
    stage_time: dict[str, float] = {}

    def stage(name: str, since: float) -> float:
        now = time.perf_counter()
        stage_time[name] = now - since
        return now

    t = time.perf_counter()
    if a.warmup_format:
        say(f"[0] format warm-up: grpo sft, {a.warmup_steps} updates on answers of the number alone")
        base = format_warmup(base, out, train_rows, a)
        t = stage("format warm-up", t)
    say(
        f"[1] the base on {len(held_out)} held-out questions ({', '.join(f'{v} {k}' for k, v in kinds.items())}) "
        f"x {a.n} samples, up to {a.max_new_tokens} tokens"
    )
    evaluations = {"base": evaluate(base, held_out, a)}
    say(f"    cut at the budget: {evaluations['base']['truncated']:.1%} of the base's samples")
    t = stage("base evaluation", t)

    arms = ["grpo"] + ([] if a.skip_ppo else ["ppo_equal_prompts", "ppo_equal_tokens"])
    jobs = []
    for arm in arms:
        for seed in range(a.seeds if arm == "grpo" else 1):
            name = f"{arm}/seed-{seed}"
            jobs.append(Job(name, f"{arm}, seed {seed}", train_config(a, base, str(data), out / name, arm, seed)))
    say(f"[2] training: {len(jobs)} runs of {a.steps} steps, {a.parallel} at a time")
    done, failed = train_all(jobs, out, a.parallel, say)
    if failed:
        say(f"failed runs: {failed}")
        return 1
    t = stage("training", t)

    say("[3] evaluating every final model")
    for job in jobs:
        evaluations[job.name] = evaluate(str(out / job.name / "final"), held_out, a)
    t = stage("RL evaluations", t)

    summary_arms: dict[str, dict] = {"base": curves(evaluations["base"])}
    for arm in arms:
        names = [job.name for job in jobs if job.name.startswith(arm + "/")]
        results = [evaluations[name] for name in names]
        entry = curves(over_seeds(results)) if len(results) > 1 else curves(results[0])
        entry["truncated"] = statistics.mean(r["truncated"] for r in results)
        entry["mean_tokens"] = statistics.mean(r["mean_tokens"] for r in results)
        costs = [run_costs(done[name]) for name in names]
        entry["cost"] = {key: round(statistics.mean(c[key] for c in costs), 3) for key in costs[0]}
        entry["per_seed"] = [{"run": name, **curves(evaluations[name]), **run_costs(done[name])} for name in names]
        summary_arms[arm] = entry
    summary = {
        "settings": {**vars(a), "model": base, "held_out_questions": len(held_out), "held_out_kinds": kinds},
        "host": host(),
        "arms": summary_arms,
        "stage_time_s": stage_time,
        "time_s": time.perf_counter() - started,
    }
    summary["findings"] = findings(summary)
    labels = {"base": "base", "grpo": f"GRPO (mean of {a.seeds})", "ppo_equal_prompts": "PPO, equal prompts"}
    labels["ppo_equal_tokens"] = "PPO, equal tokens"
    plot_curves({labels[k]: v for k, v in summary_arms.items()}, out / "fig7.png", title="Held-out questions")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    write_report(out, summary)
    for line in summary["findings"]:
        say(line)
    say(f"report: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
