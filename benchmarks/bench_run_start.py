"""What starting a training run costs: a new interpreter per run against a fork of one that
has imported torch, transformers and grpo once (grpo/infra/forkserver.py, what the demo does).

    .venv/bin/python benchmarks/bench_run_start.py            # 5 runs each way, 1 step each

Each run is `grpo train` of one GRPO step on a model of the demo's shape (a 2-layer Llama of
width 64 over the arithmetic task's characters, 32 prompts x G = 8), one thread, one run at
a time, alternating the two ways. Prints each way's median wall time per run (the command
issued to its summary read back), the time the run itself reports (`time_s`), the start-up
cost (the difference) and the helper's own start (its imports, paid once). Measure on an
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="runs each way")
    p.add_argument("--steps", type=int, default=1, help="GRPO steps per run")
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
    with run_starter(1, [model]) as starter:
        first = True
        for i in range(args.runs):
            for way in walls:
                name = f"{way.split()[0]}-{i}"
                t = time.perf_counter()
                run = train_in_child(
                    config(name),
                    work / f"{name}.yaml",
                    progress=False,
                    threads=1,
                    starter=starter if way == "forked" else None,
                )
                wall = time.perf_counter() - t
                if way == "forked" and first:  # the first fork waited for the helper's imports
                    first = False
                    print(f"          forked run {i}: {wall:.2f} s wall, the helper's imports included (not counted)")
                    continue
                walls[way].append(wall)
                inner[way].append(run["time_s"])
                print(f"{way:>16} run {i}: {wall:.2f} s wall, {run['time_s']:.2f} s training")
    print()
    base = statistics.median(walls["new interpreter"])
    for way in walls:
        w, t = statistics.median(walls[way]), statistics.median(inner[way])
        print(f"{way:>16}: {w:.2f} s a run (median), {t:.2f} s of it training, start-up {w - t:.2f} s; {w / base:.2f}x")
    print(f"host: {os.cpu_count()} CPUs; {work}")


if __name__ == "__main__":
    main()
