"""One process against several: the same GRPO run, alone and under torchrun (gloo, CPU).

    .venv/bin/python benchmarks/bench_processes.py                 # the tests' tiny model, 40 steps
    .venv/bin/python benchmarks/bench_processes.py --hidden 256 --layers 4 --steps 10

Runs `grpo train` on one config three ways, each in its own process(es), one after the
other, and prints seconds per step (median over the steps after the first), the wall time
of the whole command (start-up and model loading included), peak memory and the reward
reached:
- 1 process, 1 thread;
- 1 process, `--threads` threads (default: every core);
- torchrun with `--nproc` processes (default 2), 1 thread each, the policy sharded (FSDP2).
The prompts per step are split over the processes, so every variant does the same work per
step. Measure on an idle machine: with 2 cores, anything else running skews every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def run(command: list[str], threads: int) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def summarise(name: str, output_dir: Path, wall: float) -> dict:
    metrics = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["reward/mean"] for m in metrics]
    k = min(5, len(rewards))
    return {
        "variant": name,
        "s/step": statistics.median(m["time/step"] for m in metrics[1:]),
        "generate s": statistics.median(m["time/generate"] for m in metrics[1:]),
        "update s": statistics.median(m["time/update"] for m in metrics[1:]),
        "wall s": wall,
        "peak MB": max(m["memory/peak_mb"] for m in metrics),
        "reward first 5": sum(rewards[:k]) / k,
        "reward last 5": sum(rewards[-k:]) / k,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args(argv)

    from _tests_workload import tests_workload

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        config = tests_workload(
            tmp,
            hidden=args.hidden,
            layers=args.layers,
            prompts=args.prompts,
            group_size=args.group_size,
            max_new_tokens=args.max_new_tokens,
            steps=args.steps,
        )
        variants = [
            ("1 process, 1 thread", 1, 1),
            (f"1 process, {args.threads} threads", 1, args.threads),
            (f"{args.nproc} processes, 1 thread each", args.nproc, 1),
        ]
        for name, nproc, threads in variants:
            out = tmp / f"run-{nproc}-{threads}"
            path = tmp / f"{out.name}.yaml"
            path.write_text(json.dumps({**config, "output_dir": str(out)}))
            grpo = [sys.executable, "-m", "grpo", "train", str(path), "--quiet"]
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
            wall = run(grpo if nproc == 1 else launcher + grpo[1:], threads)
            rows.append(summarise(name, out, wall))
            print(json.dumps(rows[-1]), flush=True)

    base = rows[0]["s/step"]
    print(
        "\n| variant | s/step | x 1 process 1 thread | generate s | update s | wall s | peak MB | reward first 5 -> last 5 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['s/step']:.3f} | {r['s/step'] / base:.2f} | {r['generate s']:.3f} | {r['update s']:.3f} | "
            f"{r['wall s']:.1f} | {r['peak MB']:.0f} | {r['reward first 5']:.2f} -> {r['reward last 5']:.2f} |"
        )
    return rows


if __name__ == "__main__":
    main()
