"""One GRPO step's sampling on the realistic workload, lever by lever, in one process.

    .venv/bin/python benchmarks/bench_sampling.py [--repeats 2] [--cache-dir DIR] [--threads N]

The realistic workload of `bench_grpo_step.py` (`_realistic.py`: Qwen2 shape, vocabulary
151,936, completions that end with EOS at lengths that vary several-fold) samples 4 prompts x
G=8 completions, up to 256 new tokens, temperature 1, from the same seed, with:

1. `generate` (rollout.sampler: hf);
2. our decoding loop with every row decoded to the end and the draw over every row as
   `generate` makes it (torch.multinomial over all 32 rows each step,
   `fast.decoding.SKIP_FINISHED_DRAWS` off): the loop before the levers below;
3. + finished rows leave the LM head at once and the KV cache in batches (`fast.decoding.COMPACT_AT`);
4. + the finished rows' share of each step's draw is skipped, not drawn (`fast.draws._draw`): today;
5. today's loop with `rollout.draw: fast` (one uniform per row looked up in the
   distribution's cumulative sum in place of multinomial's exponential per vocabulary entry,
   and for fewer than 12 rows the LM head as W @ x^T): the same distribution, other tokens.

Variants 1-4 must draw the same tokens (the script checks it and says so); the fifth draws
others, so the table also gives each variant's milliseconds per completion token. The
median seconds over `--repeats` runs of each. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each variant (the median is reported)")
    parser.add_argument(
        "--cache-dir",
        default=str(ROOT / "benchmarks" / ".cache"),
        help="where the realistic workload is built once (shared with bench_grpo_step.py)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument(
        "--shape",
        choices=["full", "tiny"],
        default="full",
        help="the realistic workload's model: full (the measurement) or tiny (seconds: the code paths only)",
    )
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks import _realistic
    from grpo.rollout import Sampler, fast

    if args.threads:
        torch.set_num_threads(args.threads)
    built = _realistic.cached(Path(args.cache_dir), args.shape)
    tokenizer = AutoTokenizer.from_pretrained(built["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(built["model_dir"]).eval()
    rows = [json.loads(line) for line in Path(built["prompts"]).read_text().splitlines()[:4]]
    today = fast.decoding.COMPACT_AT, fast.decoding.SKIP_FINISHED_DRAWS
    variants = [  # name, backend, fast.decoding.COMPACT_AT, fast.decoding.SKIP_FINISHED_DRAWS, rollout.draw
        ("generate (rollout.sampler: hf)", "hf", *today, "generate"),
        ("our loop, every row to the end, draw over every row", "fast", None, False, "generate"),
        ("+ finished rows leave the head and the KV cache", "fast", today[0], False, "generate"),
        ("+ finished rows' draws skipped (today)", "fast", *today, "generate"),
        ("today, rollout.draw: fast (other tokens)", "fast", *today, "fast"),
    ]
    times = {name: [] for name, *_ in variants}
    tokens, counts = {}, {}
    try:
        for _ in range(args.repeats):
            for name, backend, compact_at, skip, draw in variants:
                fast.decoding.COMPACT_AT, fast.decoding.SKIP_FINISHED_DRAWS = compact_at, skip
                sampler = Sampler(
                    tokenizer, prompt_column="prompt", group_size=8, max_new_tokens=256, backend=backend, draw=draw
                )
                torch.manual_seed(0)
                start = time.perf_counter()
                rollout = sampler.sample(model, rows)
                times[name].append(time.perf_counter() - start)
                tokens.setdefault(name, rollout.input_ids)
                lengths = rollout.completion_mask.sum(1)
                counts[name] = (int(lengths.sum()), float(lengths.mean()), int(lengths.max()))
                print(f"{name}: {times[name][-1]:.2f} s", flush=True)
    finally:
        fast.decoding.COMPACT_AT, fast.decoding.SKIP_FINISHED_DRAWS = today
    reference = tokens[variants[0][0]]
    same = all(torch.equal(tokens[name], reference) for name, *_, draw in variants if draw == "generate")
    total, mean, longest = counts[variants[0][0]]
    print(
        f"\n32 completions, {total} tokens; lengths mean {mean:.1f}, max {longest} "
        f"(decoding steps); torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"every variant of generate's draw drew the same tokens: {'yes' if same else 'NO'}\n")
    print(
        "| sampling one step | median s | vs generate | tokens (mean / max length) | ms per token | per token vs generate |"
    )
    print("|---|---|---|---|---|---|")
    base = statistics.median(times[variants[0][0]])
    for name, *_ in variants:
        t = statistics.median(times[name])
        n, mean, longest = counts[name]
        print(
            f"| {name} | {t:.2f} | {t / base:.2f} | {n} ({mean:.1f} / {longest}) | {1000 * t / n:.2f} | "
            f"{(t / n) / (base / total):.2f} |"
        )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
