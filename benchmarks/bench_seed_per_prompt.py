"""What `rollout.seed_per_prompt` costs: the same GRPO run with one random stream per process
and with a generator per prompt, for each sampler, in this process, alternating.

    .venv/bin/python benchmarks/bench_seed_per_prompt.py                     # tiny model, 64 tokens
    .venv/bin/python benchmarks/bench_seed_per_prompt.py --hidden 256 --layers 4

Prints the median time/generate and time/step over the steps after the first two, twice per
setting (the spread between the two is the noise). Measure on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=22)
    parser.add_argument("--samplers", default="fast,hf")
    args = parser.parse_args(argv)

    import grpo
    from _tests_workload import tests_workload

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = tests_workload(
            tmp, hidden=args.hidden, layers=args.layers, max_new_tokens=args.max_new_tokens, steps=args.steps
        )
        for sampler in args.samplers.split(","):
            for per_prompt in (False, True, False, True):
                config = {
                    **base,
                    "output_dir": str(tmp / f"run-{len(rows)}"),
                    "rollout": {**base["rollout"], "seed_per_prompt": per_prompt, "sampler": sampler},
                }
                metrics = grpo.train(config, progress=False).metrics[2:]
                rows.append(
                    {
                        "sampler": sampler,
                        "seed_per_prompt": per_prompt,
                        "generate s": statistics.median(m["time/generate"] for m in metrics),
                        "step s": statistics.median(m["time/step"] for m in metrics),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    print("\n| sampler | seed_per_prompt | time/generate s | time/step s |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['sampler']} | {r['seed_per_prompt']} | {r['generate s']:.3f} | {r['step s']:.3f} |")
    return rows


if __name__ == "__main__":
    main()
