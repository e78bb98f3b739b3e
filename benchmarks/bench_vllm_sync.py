"""What keeping a colocated vLLM engine in sync costs: the weight copy and the check, per sync.

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/bench_vllm_sync.py            # SmolLM2-135M's shape
    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/bench_vllm_sync.py --tiny     # the tests' tiny Qwen2

Builds one engine (`grpo.vllm.engine.LocalEngine`, through the decoder's `local_engine`) for
a randomly initialised model, then `--syncs` times moves every weight a little and syncs: the
in-place reload (`load_weights`) and the fixed-sequence check (`check`) are timed apart. The
first check includes the engine's first generation (its warm-up). Prints one line per sync
and the check's mean |log-prob difference|. Needs vLLM (docs/vllm.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def model(tiny: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        from grpo.tasks.tiny import char_tokenizer
        from tests.vllm.models import ALPHABET, build

        return build("qwen2", char_tokenizer(ALPHABET))
    config = LlamaConfig(  # SmolLM2-135M's shape: 30 layers, head_dim 64, a tied 49152-token head
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny Qwen2 instead of SmolLM2's shape")
    parser.add_argument("--syncs", type=int, default=6)
    args = parser.parse_args()

    import torch

    from grpo.vllm.decoder import EngineOptions, local_engine
    from grpo.vllm.engine import policy_weights

    policy = model(args.tiny)
    start = time.perf_counter()
    engine = local_engine(policy, EngineOptions(max_model_len=256, max_num_seqs=16))
    print(f"engine built in {time.perf_counter() - start:.1f} s")
    for i in range(args.syncs):
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 1e-4)
        start = time.perf_counter()
        engine.load_weights(policy_weights(policy))
        loaded = time.perf_counter()
        gap = engine.check(policy, tolerance=1e-3)
        checked = time.perf_counter()
        print(f"sync {i}: load {loaded - start:.3f} s, check {checked - loaded:.3f} s, mean |dlogp| {gap:.1e}")


if __name__ == "__main__":
    main()
