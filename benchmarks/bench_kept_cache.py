"""What keeping the fast loop's KV cache across turns buys a multi-turn rollout.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_kept_cache.py [--temperature 1.2] [--repeats 3]

The tests' tiny tool-calling model (tests/rollout/tool_models.py: a character tokenizer
whose chat template writes the tools' JSON schemas into the system turn, so each prompt is
about 900 tokens) samples 8 prompts x G=8 rollouts with multiply and async_add, at most one
tool turn each, up to 250 tokens; with grpo.rollout.turns.KEEP_CACHE on (a later turn runs
only its new tokens on the kept cache) and off (every turn computes its whole context again),
alternately, --repeats times each after a warm-up. Prints the mean time per sample of each.
The rollouts are the same either way (tests/rollout/test_tools.py checks it).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--temperature", type=float, default=1.2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.rollout import turns
    from grpo.rollout.sampler import Sampler
    from grpo.rollout.tools import Toolbox
    from tests.rollout.tool_models import MULTIPLY_PROMPT, async_add, multiply, save_tool_model

    directory = save_tool_model(Path(tempfile.mkdtemp()) / "tool_model")
    model, tok = AutoModelForCausalLM.from_pretrained(directory).eval(), AutoTokenizer.from_pretrained(directory)
    rows = [{"prompt": MULTIPLY_PROMPT}] * 8
    times: dict[bool, list[float]] = {False: [], True: []}
    for keep in [False, True] * (args.repeats + 1):
        turns.KEEP_CACHE = keep
        sampler = Sampler(
            tok,
            prompt_column="prompt",
            group_size=8,
            max_new_tokens=250,
            temperature=args.temperature,
            backend="fast",
            seed=0,
            tools=Toolbox([multiply, async_add], max_calls=1),
        )
        start = time.perf_counter()
        rollout = sampler.sample(model, rows)
        times[keep].append(time.perf_counter() - start)
    prompt = rollout.input_ids.shape[1] - rollout.completion_mask.shape[1]
    print(
        f"{len(rollout)} rollouts, prompt {prompt} tokens, tool calls per rollout {float(rollout.tool_calls.mean()):.2f}"
    )
    for keep, label in ((False, "every turn recomputed"), (True, "cache kept across turns")):
        print(f"{label}: {statistics.mean(times[keep][1:]):.3f} s per sample (first, a warm-up, left out)")


if __name__ == "__main__":
    main()
