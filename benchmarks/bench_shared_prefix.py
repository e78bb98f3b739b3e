"""What reading each prompt's keys and values once for its G rows buys the fast draw.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_shared_prefix.py [--shapes 30x4,150x4,300x4,500x8] [--repeats 3]

SmolLM2-135M-Instruct (`make smollm2`; fp32, the fast draw's packed weights, the head, down and
output projections packed too, as a training run with room packs them) samples 2 prompts of
N random tokens x G rows, 128 new tokens each (no row stops early), with the rows' attention
reading one copy of their prompt's cache (`_Cache.share`) and with a copy a row
(`_Cache.repeat`), alternately, --repeats times each after a warm-up; whatever
`fast.decoding.SHARE_FROM` would choose. Prints the median seconds of each and the size of the
copies a layer (what `SHARE_FROM` is compared with). Measure on an idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", default="30x4,150x4,300x4,500x8", help="prompt tokens x rows a prompt, comma-separated"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-dir", type=Path, default=Path(__file__).parent / ".cache")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks import smollm2
    from grpo.rollout import fast
    from grpo.rollout.fast import decoding
    from grpo.rollout.params import SamplingParams

    directory = smollm2.cached(args.cache_dir, log=lambda line: print(line, flush=True))
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    p = SamplingParams.of(tokenizer, max_new_tokens=128, min_new_tokens=128, temperature=1.0)
    w = fast.fuse_weights(model, torch.float32, pack=True)
    fast.pack_single_matrices(w, 1 << 40)
    share_from = decoding.SHARE_FROM
    print(f"torch threads {torch.get_num_threads()}; SHARE_FROM {share_from / 2**20:.1f} MiB a layer")
    for shape in args.shapes.split(","):
        length, group = (int(x) for x in shape.split("x"))
        ids = torch.randint(100, 1000, (2, length), generator=torch.Generator().manual_seed(0))
        counts = torch.tensor([group, group])
        copies = fast.forward.cache_bytes(w, 2 * (group - 1) * length)  # a layer's, as SHARE_FROM counts them
        times: dict[bool, list[float]] = {False: [], True: []}
        for shared in [False, True] * (args.repeats + 1):
            decoding.SHARE_FROM = 0 if shared else 1 << 62
            start = time.perf_counter()
            fast.decode(
                model, ids, torch.ones_like(ids), counts, p, weights=w, generators=[torch.Generator().manual_seed(1)]
            )
            times[shared].append(time.perf_counter() - start)
        decoding.SHARE_FROM = share_from
        one, each = statistics.median(times[True][1:]), statistics.median(times[False][1:])
        chosen = "one copy" if copies >= share_from else "a copy a row"
        print(
            f"prompts of {length} tokens x {group} rows (copies {copies / 2**20:.1f} MiB a layer, SHARE_FROM picks {chosen}): "
            f"one copy {one:.2f} s, a copy a row {each:.2f} s ({one / each:.2f}x)"
        )


if __name__ == "__main__":
    main()
