"""What starting a training run costs: a new interpreter per run against a fork of one that
has imported torch, transformers and grpo once (grpo/infra/forkserver.py, what the demo does).

    .venv/bin/python benchmarks/bench_run_start.py                                  # 5 runs each way, 1 step each
    .venv/bin/python benchmarks/bench_run_start.py --steps 40 --parallel 2 --runs 2  # as the demo runs them

Each run is `grpo train` of `--steps` GRPO steps on a model of the demo's shape (a 2-layer
Llama of width 64 over the arithmetic task's characters, 32 prompts x G = 8) on one thread,
`--parallel` runs at once, the two ways alternating round by round. Prints each way's median
wall time of a round (the runs issued to their summaries read back) and the training time
the runs report (`time_s`): with one run at a time, the difference is the start-up. The
helper's own start (its imports, paid once) is a warm-up round, not counted. Measure on an
idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="runs each way")
    p.add_argument("--steps", type=int, default=1, help="GRPO steps per run")
    p.add_argument("--parallel", type=int, default=1, help="runs at once, one thread each (the demo: 2)")
    args = p.parse_args()

    from grpo.infra import forkserver
    from grpo.infra.child import run_starter, train_in_child
    from grpo.tasks import arithmetic
    from grpo.tasks.tiny import save_tiny_model

    if not forkserver.available():
        sys.exit("bench_run_start: the fork server runs on Linux only")
    work = Path(tempfile.mkdtemp(prefix="bench-run-start-"))
    model = str(save_tiny_model(work / "model", arithmetic.ALPHABET, hidden_size=64, layers=2, heads=4))
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in arithmetic.make_rows(256, seed=1, digits=[2, 3])))

    def config(name: str) -> dict:
        return {
            "algorithm": "grpo",
            "model": model,
            "seed": 0,
            "output_dir": str(work / name),
            "data": {"path": str(data)},
            "rewards": [{"function": "arithmetic_correct", "weight": 1.0}],
            "rollout": {"group_size": 8, "prompts_per_step": 32, "max_new_tokens": 36, "temperature": 0.7},
            "train": {"steps": args.steps, "lr": 1e-4, "minibatches": 4},
        }

    walls: dict[str, list[float]] = {"new interpreter": [], "forked": []}
    inner: dict[str, list[float]] = {"new interpreter": [], "forked": []}
    with run_starter(1, [model]) as starter, ThreadPoolExecutor(args.parallel) as pool:

        def round_of(way: str, tag: str) -> tuple[float, float]:
            """`parallel` runs at once: (the round's wall time, the runs' mean training time)."""
            forked = starter if way == "forked" else None
            t = time.perf_counter()
            runs = list(
                pool.map(
                    lambda k: train_in_child(
                        config(f"{tag}-{k}"), work / f"{tag}-{k}.yaml", progress=False, threads=1, starter=forked
                    ),
                    range(args.parallel),
                )
            )
            return time.perf_counter() - t, statistics.mean(run["time_s"] for run in runs)

        wall, _ = round_of("forked", "warm-up")  # the first fork waits for the helper's imports
        print(f"the helper's imports and a first round: {wall:.2f} s (not counted)")
        for i in range(args.runs):
            for way in walls:
                wall, training = round_of(way, f"{way.split()[0]}-{i}")
                walls[way].append(wall)
                inner[way].append(training)
                print(f"{way:>16} round {i}: {wall:.2f} s wall, {training:.2f} s training a run")
    print()
    base = statistics.median(walls["new interpreter"])
    at_once = f"{args.parallel} runs at once" if args.parallel > 1 else "one run"
    for way in walls:
        w, t = statistics.median(walls[way]), statistics.median(inner[way])
        start = f", start-up {w - t:.2f} s" if args.parallel == 1 else ""
        print(f"{way:>16}: {w:.2f} s a round of {at_once} (median), {t:.2f} s training a run{start}; {w / base:.2f}x")
    print(f"host: {os.cpu_count()} CPUs; {work}")


if __name__ == "__main__":
    main()
