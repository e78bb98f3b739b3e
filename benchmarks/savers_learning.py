"""Does the real-model walkthrough's task learn as well with the memory savers on? GRPO on
SmolLM2-135M-Instruct (README, "A real model"; `make smollm2` first), the exact path against
the four savers together (8-bit AdamW, the step in the backward without clipping, a bf16
reference, freed memory given back), over the same seeds; the training reward by tens of
steps, each variant's mean over the seeds and its spread.

    .venv/bin/python benchmarks/savers_learning.py [--seeds 0,1,2] [--steps 30] [--parallel 2] [--out runs/savers-learning]

The runs are `grpo train` commands, `--parallel` at a time with one thread each (the reward
curve, not the time, is what this measures). Settings as the walkthrough's (4 prompts x 8
completions, 48 new tokens, temperature 0.7, lr 1e-5, beta 0.04) with `rollout.draw: fast`.
Prints one line per run and the table; writes OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VARIANTS = {
    "exact": [],
    "savers": [
        "train.optimizer=adamw_8bit",
        "train.reference_dtype=bfloat16",
        "train.optimizer_in_backward=true",
        "train.max_grad_norm=0",
        "train.return_freed_memory=true",
    ],
}


def config(model: str, out: Path, data: Path, steps: int, seed: int) -> str:
    return f"""algorithm: grpo
model: {model}
output_dir: {out}
seed: {seed}
data: {{path: {data}}}
rewards:
  - {{function: "examples.smollm2.tasks:final_number"}}
rollout: {{group_size: 8, prompts_per_step: 4, max_new_tokens: 48, temperature: 0.7, draw: fast}}
train: {{steps: {steps}, lr: 1.0e-5, checkpoint_every: 0, log_every: 10}}
loss: {{beta: 0.04}}
"""


def tens(rewards: list[float]) -> list[float]:
    """The mean reward of each ten steps (the last group may be shorter)."""
    return [statistics.fmean(rewards[i : i + 10]) for i in range(0, len(rewards), 10)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds; default 0,1,2")
    parser.add_argument("--steps", type=int, default=30, help="GRPO steps a run; default 30")
    parser.add_argument("--parallel", type=int, default=2, help="runs at once, one thread each; default 2")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "savers-learning")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    model = subprocess.run(
        [sys.executable, str(HERE / "smollm2.py")], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    args.out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "examples/smollm2/tasks.py", str(args.out)], cwd=ROOT, check=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    jobs = [(variant, seed) for seed in seeds for variant in VARIANTS]
    running: list[tuple[str, int, subprocess.Popen, float]] = []
    results: dict[str, dict[int, list[float]]] = {v: {} for v in VARIANTS}
    while jobs or running:
        while jobs and len(running) < args.parallel:
            variant, seed = jobs.pop(0)
            run_dir = args.out / f"{variant}-seed{seed}"
            path = args.out / f"{variant}-seed{seed}.yaml"
            path.write_text(config(model, run_dir, args.out / "train.jsonl", args.steps, seed))
            command = [
                str(ROOT / ".venv" / "bin" / "grpo"),
                "train",
                str(path),
                "--overwrite",
                *(a for s in VARIANTS[variant] for a in ("--set", s)),
            ]
            log = open(args.out / f"{variant}-seed{seed}.log", "w")
            running.append(
                (variant, seed, subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log), time.time())
            )
        time.sleep(5)
        for job in list(running):
            variant, seed, process, started = job
            if process.poll() is None:
                continue
            running.remove(job)
            if process.returncode != 0:
                print(f"{variant} seed {seed}: failed ({process.returncode}); see {args.out}/{variant}-seed{seed}.log")
                continue
            metrics = [
                json.loads(line)
                for line in (args.out / f"{variant}-seed{seed}" / "metrics.jsonl").read_text().splitlines()
                if line.strip()
            ]
            rewards = [m["reward/mean"] for m in metrics if "reward/mean" in m]
            results[variant][seed] = rewards
            shown = ", ".join(f"{r:.3f}" for r in tens(rewards))
            print(f"{variant} seed {seed}: reward by tens {shown} ({(time.time() - started) / 60:.1f} min)", flush=True)
    print(
        "\n| variant | seeds | reward by tens of steps (mean over seeds) | last ten: mean | last ten: min-max over seeds |"
    )
    print("| --- | --- | --- | --- | --- |")
    summary = {}
    for variant, runs in results.items():
        if not runs:
            continue
        curves = [tens(r) for r in runs.values()]
        width = min(len(c) for c in curves)
        mean = [statistics.fmean(c[i] for c in curves) for i in range(width)]
        last = [c[width - 1] for c in curves]
        summary[variant] = {"seeds": sorted(runs), "rewards": runs, "mean_by_tens": mean}
        print(
            f"| {variant} | {len(runs)} | {', '.join(f'{m:.3f}' for m in mean)} | {statistics.fmean(last):.3f} | "
            f"{min(last):.3f}-{max(last):.3f} |"
        )
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
