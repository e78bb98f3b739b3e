"""Asynchronous rollouts against the synchronous step (issue 27): the same GRPO run on the
realistic workload, side by side.

    .venv/bin/python benchmarks/bench_async.py                      # the realistic workload, 30 steps
    .venv/bin/python benchmarks/bench_async.py --shape tiny --steps 4   # a quick check that it runs
        [--steps N] [--max-staleness K] [--lr LR] [--sync-threads 2] [--cache-dir DIR] [--rebuild] [--results DIR]

Two runs, one after the other, each `grpo train` in a child process, on a 2-core budget:
- sync: rollout.async.max_staleness 0 (sample, then train), the trainer on 2 torch threads;
- async: rollout.async.max_staleness K (default 1): the generator process samples the next
  batch while the trainer trains this one, each on 1 torch thread (rollout.async.threads 1,
  the trainer's OMP_NUM_THREADS 1).

The workload is `bench_grpo_step.py`'s realistic one (`_realistic.py`: a Qwen2 shape with
Qwen2.5's vocabulary, warmed up so that completions end with EOS at varying lengths; built
once into --cache-dir), with its settings (4 prompts x G = 8, up to 256 new tokens, beta
0.04, the sevens reward) and --lr.

Per run: the median step time over steps 2..N (step 1 pays for warm-up, and the async run's
for starting its generator), the completion tokens per second (median over the same steps
of tokens generated / step time), the run's wall time, and the reward per sample seen (the
mean reward of the first and last quarter of the steps; both runs see the same samples per
step, so their curves compare step by step, printed too). The async run also reports its
staleness, drops, and the trainer's and generator's waits. Results go to stdout and to
benchmarks/results/async-<date-time>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a script: `benchmarks.*` is imported by name
    sys.path.insert(0, str(ROOT))

from benchmarks import bench_grpo_step as bench  # noqa: E402


def run(w: dict, root: Path, steps: int, threads: int, overrides: list[str]) -> dict:
    """One `grpo train` (bench_grpo_step's run_ours) with `threads` torch threads in the trainer."""
    root.mkdir(parents=True, exist_ok=True)
    before = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))  # the child inherits them
    try:
        return bench.run_ours(w, root, steps, "fp32", "auto", None, overrides=overrides)
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def summarize(r: dict) -> dict:
    """Step time, tokens/s, reward per sample seen (and the async metrics) of one run."""
    steps = r["steps"]
    timed = steps[1:] or steps  # step 1: warm-up (and the generator's start)
    quarter = max(len(steps) // 4, 1)
    rewards = [m["reward/mean"] for m in steps]
    summary = {
        "steps": len(steps),
        "step_s_median": statistics.median(m["time/step"] for m in timed),
        "tokens_per_s_median": statistics.median(m["tokens/completion"] / m["time/step"] for m in timed),
        "process_wall_s": r["process_wall_s"],
        "samples_per_step": None,  # filled by the caller
        "reward_first_quarter": statistics.fmean(rewards[:quarter]),
        "reward_last_quarter": statistics.fmean(rewards[-quarter:]),
        "reward_per_step": rewards,
    }
    if "async/staleness" in steps[0]:
        summary["async"] = {
            "staleness_mean": statistics.fmean(m["async/staleness"] for m in steps),
            "staleness_max": max(m["async/staleness_max"] for m in steps),
            "dropped": sum(m["async/dropped"] for m in steps),
            "queue_wait_s_median": statistics.median(m["async/queue_wait_s"] for m in timed),
            "generator_wait_s_median": statistics.median(m["async/generator_wait_s"] for m in timed),
            "push_s_median": statistics.median(m["async/push_s"] for m in timed),
            "generate_s_median": statistics.median(m["time/generate"] for m in timed),
            "update_s_median": statistics.median(m["time/update"] for m in timed),
        }
    return summary


def table(runs: dict) -> str:
    sync, asyn = runs["sync"], runs["async"]
    lines = [
        "| run | step s (median, 2..N) | tokens/s | wall s | reward, first / last quarter |",
        "|---|---|---|---|---|",
    ]
    for name, s in runs.items():
        lines.append(
            f"| {name} | {s['step_s_median']:.2f} | {s['tokens_per_s_median']:.0f} | {s['process_wall_s']:.0f} | "
            f"{s['reward_first_quarter']:.3f} / {s['reward_last_quarter']:.3f} |"
        )
    a = asyn["async"]
    lines += [
        "",
        f"async / sync step time: {asyn['step_s_median'] / sync['step_s_median']:.2f}; "
        f"staleness mean {a['staleness_mean']:.2f}, max {a['staleness_max']}, dropped {a['dropped']}; "
        f"medians: trainer waits {a['queue_wait_s_median']:.2f} s, generator waits {a['generator_wait_s_median']:.2f} s, "
        f"generate {a['generate_s_median']:.2f} s, update {a['update_s_median']:.2f} s, push {a['push_s_median']:.3f} s",
        "",
        "reward per step (the same samples per step in both runs):",
        "  sync:  " + " ".join(f"{r:.3f}" for r in sync["reward_per_step"]),
        "  async: " + " ".join(f"{r:.3f}" for r in asyn["reward_per_step"]),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("full", "tiny"), default="full", help="the realistic workload's size")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max-staleness", type=int, default=1, help="K of the async run")
    parser.add_argument("--lr", type=float, default=None, help="default: the realistic workload's")
    parser.add_argument("--sync-threads", type=int, default=2, help="the synchronous trainer's torch threads")
    parser.add_argument("--cache-dir", type=Path, default=HERE / ".cache")
    parser.add_argument("--rebuild", action="store_true")
    parser.add_argument("--results", type=Path, default=HERE / "results", help="folder for the JSON results")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        w = bench.build_realistic(root, args.cache_dir, args.shape, args.rebuild)
        w["reward"] = "bench_reward:sevens"  # no length recording: the runs are compared on time and reward
        w["record_lengths"] = False
        if args.lr is not None:
            w["settings"] = {**w["settings"], "lr": args.lr}
        plans = {
            "sync": (args.sync_threads, ["rollout.async.max_staleness=0"]),
            "async": (1, [f"rollout.async.max_staleness={args.max_staleness}", "rollout.async.threads=1"]),
        }
        runs = {}
        for name, (threads, overrides) in plans.items():
            print(f"[async] {name}: {args.steps} steps, trainer on {threads} thread(s) ...", flush=True)
            runs[name] = summarize(run(w, root / name, args.steps, threads, overrides))
            runs[name]["samples_per_step"] = w["settings"]["group_size"] * w["settings"]["prompts_per_step"]
    print(table(runs))
    results = {
        "benchmark": "bench_async",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpu": bench.cpu_model(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
        },
        "shape": args.shape,
        "settings": {
            **w["settings"],
            "steps": args.steps,
            "max_staleness": args.max_staleness,
            "sync_threads": args.sync_threads,
        },
        "runs": runs,
    }
    bench.write_results(results, args.results, prefix="async-")
    return 0


if __name__ == "__main__":
    sys.exit(main())
