"""Packed passes through the 4-D mask against attention by segments (grpo.infra.attention).

    .venv/bin/python benchmarks/bench_segments.py [--shapes demo,realistic,smollm2] [--reps 5] [--threads 2] [--every-bin]

For each shape, a randomly initialised model of that shape (eager attention, the CPU's
default) and one micro-batch as the update sees it: P prompts x G completions, each group's
prompt packed once, completion lengths drawn log-normally (median ~37 tokens, a long tail)
and cut at the shape's budget. Each mode runs in its own process (so that its peak resident
memory is its own): the packed forward and backward of the completion log-probs (chunked
head), `--reps` times; printed are the median time, the peak RSS, and the ratio of
segments to mask. The shapes:
- demo: `grpo demo`'s model (Llama, hidden 64, 2 layers, 4 heads, 20 tokens), 4 prompts of
  10 tokens x G=8, up to 36 new tokens;
- realistic: bench_grpo_step.py's realistic workload's shape (Qwen2, hidden 256, 4 layers,
  4 heads, a 151,936-token tied head), 4 prompts of 12 x G=8, up to 256;
- smollm2: SmolLM2-135M's shape (Llama, hidden 576, 30 layers, 9 heads, 49,152 tokens, tied),
  2 prompts of 100 x G=4, up to 128.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from benchmarks import _realistic  # noqa: E402 (after the path: run as a script)

SHAPES = {
    "demo": (
        "llama",
        dict(vocab_size=20, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128),
        dict(prompts=4, group_size=8, prompt_length=10, budget=36),
    ),
    "realistic": (
        "qwen2",
        dict(_realistic.SHAPES["full"], tie_word_embeddings=True),
        dict(prompts=4, group_size=8, prompt_length=_realistic.PROMPT_LENGTH, budget=256),
    ),
    "smollm2": (
        "llama",
        dict(
            vocab_size=49152,
            hidden_size=576,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            intermediate_size=1536,
            tie_word_embeddings=True,
        ),
        dict(prompts=2, group_size=4, prompt_length=100, budget=128),
    ),
}


def micro_batch(vocab: int, prompts: int, group_size: int, prompt_length: int, budget: int, seed: int = 0):
    """A rollout of `prompts` x `group_size` rows: each group's prompt, completions of log-normal
    lengths (median e^3.6 ~ 37 tokens) cut at `budget`, right-padded."""
    import torch

    from grpo.rollout import Rollout

    g = torch.Generator().manual_seed(seed)
    n = prompts * group_size
    lengths = [max(1, min(budget, int(math.exp(3.6 + 0.8 * float(torch.randn(1, generator=g)))))) for _ in range(n)]
    width = max(lengths)
    rows, masks, completion_masks = [], [], []
    for i in range(prompts):
        prompt = torch.randint(3, vocab, (prompt_length,), generator=g)
        for j in range(group_size):
            c = lengths[i * group_size + j]
            completion = torch.randint(3, vocab, (width,), generator=g)
            completion[c:] = 0
            rows.append(torch.cat([prompt, completion]))
            masks.append(torch.cat([torch.ones(prompt_length + c), torch.zeros(width - c)]))
            completion_masks.append(torch.cat([torch.ones(c), torch.zeros(width - c)]))
    return Rollout(
        input_ids=torch.stack(rows),
        attention_mask=torch.stack(masks).long(),
        completion_mask=torch.stack(completion_masks),
        prompts=[""] * n,
        completions=[""] * n,
        rows=[{}] * n,
        group_size=group_size,
    )


def child(shape: str, mode: str, reps: int, every_bin: bool) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo.infra import attention
    from grpo.train import packed_layout
    from grpo.train.layouts import PACKED, completion_logprobs, decide_layouts

    model_type, sizes, batch_shape = SHAPES[shape]
    config = AutoConfig.for_model(model_type, attn_implementation="eager", **{"max_position_embeddings": 2048, **sizes})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    decide_layouts(model, False)
    if mode == "mask":
        attention.SEGMENTED_FROM = math.inf  # every bin through the mask
    elif every_bin:
        attention.SEGMENTED_FROM = 0
    batch = micro_batch(sizes["vocab_size"], **batch_shape)
    bins = packed_layout.pack(batch, packed_layout.prompt_groups(batch)[1]).input_ids.shape
    times, before = [], attention._segmented_calls[0]
    for _ in range(reps):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        logprobs = completion_logprobs(model, batch, 1.0, layout=PACKED, chunked_head=True)[0]
        (logprobs * batch.completion_mask).sum().backward()
        times.append(time.perf_counter() - start)
    return {
        "median_s": statistics.median(times[1:] or times),
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "bins": list(bins),
        "real_tokens": int(batch.completion_mask.sum()) + batch_shape["prompts"] * batch_shape["prompt_length"],
        "by_segments": attention._segmented_calls[0] > before,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of: " + ", ".join(SHAPES))
    parser.add_argument("--reps", type=int, default=5, help="passes a mode (the first not counted); default 5")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each run (default 2)")
    parser.add_argument(
        "--every-bin",
        action="store_true",
        help="segments also for bins under grpo.infra.attention.SEGMENTED_FROM (how that threshold was chosen)",
    )
    parser.add_argument("--child", nargs=2, metavar=("SHAPE", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.reps, args.every_bin)))
        return
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            sys.exit(f"bench_segments: error: --shapes: unknown shape {shape!r} (choose from {', '.join(SHAPES)})")
        found = {}
        for mode in ("mask", "segments"):
            command = [sys.executable, __file__, "--child", shape, mode, "--reps", str(args.reps)]
            command += ["--every-bin"] if args.every_bin else []
            done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
            if done.returncode != 0:
                sys.exit(f"bench_segments: {shape} {mode} failed: {done.stderr.strip().splitlines()[-1]}")
            found[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        mask, seg = found["mask"], found["segments"]
        print(
            f"{shape}: bins {mask['bins'][0]} x {mask['bins'][1]} slots, {mask['real_tokens']} real tokens; "
            f"forward + backward {mask['median_s']:.3f} s through the mask, {seg['median_s']:.3f} s by segments "
            f"({seg['median_s'] / mask['median_s']:.2f}x); peak RSS {mask['peak_mb']:,.0f} MB against "
            f"{seg['peak_mb']:,.0f} MB ({seg['peak_mb'] - mask['peak_mb']:+,.0f} MB)"
            + ("" if seg["by_segments"] else "  [the segments were not taken: bins under SEGMENTED_FROM]")
        )


if __name__ == "__main__":
    main()
