"""Why the reference model is replicated, not sharded, over torchrun processes: the time of
its forward pass (the reference log-probs of a step) both ways, in the same processes.

    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/bench_reference_sharding.py
    ... benchmarks/bench_reference_sharding.py --hidden 512 --layers 8 --rows 32 --length 48

Each process holds the same Llama built from a config twice: a plain replica, and a copy
sharded with FSDP2 as grpo shards the policy (`grpo.infra.distributed.ProcessGroup.shard`).
Both run the same no-grad forward on this process's rows; the sharded one all-gathers each
block's weights on the way. Prints the median seconds per pass (process 0) and the weights
each process holds. Run on an idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=16, help="rows per process")
    parser.add_argument("--length", type=int, default=40, help="tokens per row")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    import copy

    from grpo.infra.distributed import init_world
    from grpo.tasks.tiny import char_tokenizer, tiny_llama

    torch.set_num_threads(1)
    world = init_world(torch.device("cpu"), "gloo")
    model = tiny_llama(char_tokenizer("0123456789abc "), hidden_size=args.hidden, layers=args.layers, heads=8).eval()
    replica = copy.deepcopy(model)
    sharded = world.shard(model)
    held = {  # weights per process (the root unit stays gathered after a forward without backward)
        "replicated": sum(p.numel() for p in replica.parameters()),
        "sharded": sum(p.to_local().numel() for p in sharded.parameters()),
    }
    ids = torch.randint(4, 18, (args.rows, args.length), generator=torch.Generator().manual_seed(world.rank))

    def timed(network) -> float:
        times = []
        for _ in range(args.repeats):
            world.barrier()
            start = time.perf_counter()
            with torch.inference_mode():
                network(input_ids=ids, use_cache=False)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    results = {"replicated": timed(replica), "sharded": timed(sharded)}
    if world.is_main:
        print(
            f"{world.world_size} processes, hidden {args.hidden}, {args.layers} layers, {args.rows} rows x {args.length} tokens each"
        )
        for name in results:
            print(f"{name:>10}: {results[name]:.4f} s per pass, {held[name]:,} weights held per process")
        print(f"sharded / replicated: {results['sharded'] / results['replicated']:.2f}")
    world.close()


if __name__ == "__main__":
    main()
