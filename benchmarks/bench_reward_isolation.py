"""What containing a reward function costs per call: `score` on one batch with the function
called in this process, on a thread (rewards[].timeout), and in a worker process
(rewards[].isolate), alternating; and what starting a worker costs.

    .venv/bin/python benchmarks/bench_reward_isolation.py                 # 32 completions, 50 calls
    .venv/bin/python benchmarks/bench_reward_isolation.py --spec r1_format --completions 256

The default function is `rule` below, a cheap regex rule in a module that imports no more
than a user's would (a built-in's module imports the grpo.rewards package, torch with it,
which is what a worker's start then costs), so the times are the containment's own.
Prints the median time of a call per setting and its overhead over the plain call. Measure
on an idle machine, and say how idle it was (the load average is printed).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # this file is the default spec's module

_ANSWER = re.compile(r"<think>.*?</think>\s*<answer>(.*?)</answer>", re.DOTALL)

SETTINGS = {
    "in process": {},
    "thread (timeout)": {"timeout": 60.0},
    "worker (isolate)": {"isolate": True},
    "worker + timeout": {"isolate": True, "timeout": 60.0},
}


def rule(prompts, completions, answer, **columns):
    """1.0 for a well-formed completion whose answer is the `answer` column, else 0.0."""
    found = [_ANSWER.search(c) for c in completions]
    return [float(m is not None and m.group(1).strip() == a) for m, a in zip(found, answer)]


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default="bench_reward_isolation:rule")
    parser.add_argument("--completions", type=int, default=32)
    parser.add_argument("--calls", type=int, default=50, help="per setting, in rounds of 10, alternating")
    parser.add_argument("--starts", type=int, default=5, help="worker starts to time")
    args = parser.parse_args(argv)

    from grpo.rewards import load_rewards, score
    from grpo.infra.contain import stop_workers

    n = args.completions
    prompts = [f"What is {i} + {i}? Think, then answer." for i in range(n)]
    completions = [
        f"<think>{i} plus {i} is {2 * i}, as {i} * 2 = {2 * i}.</think><answer>{2 * i}</answer>" * 2 for i in range(n)
    ]
    columns = {"answer": [str(2 * i) for i in range(n)]}
    rewards = {name: load_rewards([(args.spec, 1.0)], [options])[0] for name, options in SETTINGS.items()}

    def seconds(reward) -> float:
        started = time.perf_counter()
        score([reward], prompts, completions, columns)
        return time.perf_counter() - started

    starts = []
    for _ in range(args.starts):
        stop_workers()
        starts.append(seconds(rewards["worker (isolate)"]))  # the first call starts the worker

    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for name, reward in rewards.items():
        seconds(reward)  # warm: imports, the worker's first call
    for _ in range(max(args.calls // 10, 1)):
        for name, reward in rewards.items():
            times[name].extend(seconds(reward) for _ in range(10))
    stop_workers()

    print(
        f"{n} completions, {args.spec}, {len(times['in process'])} calls per setting, "
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
    )
    medians = {name: statistics.median(t) for name, t in times.items()}
    plain = medians["in process"]
    print(f"{'setting':<20} {'median ms/call':>15} {'overhead ms':>12}")
    for name, median in medians.items():
        print(f"{name:<20} {median * 1e3:>15.3f} {(median - plain) * 1e3:>12.3f}")
    medians["worker start"] = statistics.median(starts)
    print(f"{'worker start':<20} {medians['worker start'] * 1e3:>15.1f}   (first call, median of {len(starts)})")
    return medians


if __name__ == "__main__":
    main()
