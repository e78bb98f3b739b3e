"""The fast sampling loop: `generate`'s computation for Llama-family models without its per-token
Python overhead (on a CPU with a small model, `generate` spends most of a decoding step in
cache objects, masks and processors, not in arithmetic). One preallocated KV cache; each
prompt's prefix computed once for its G completions; q/k/v and gate/up fused into one matmul
each; finished rows leave the loop. `decode(keep=True)` and `extend` go on from a kept cache
(multi-turn rollouts). From the same random numbers it draws the same tokens as `generate`
(tests/rollout/test_fast.py), and returns each token's log-prob. A model it cannot run
(`supported` says why) samples with `generate`. forward.py holds the pass, draws.py the
processors and draws, decoding.py the loops; the options: docs/sampling.md.
"""

from grpo.rollout.fast.draws import process
from grpo.rollout.fast.forward import cache_dtype, fuse_weights, pack_single_matrices
from grpo.rollout.fast.decoding import ARCHITECTURES, Kept, decode, extend, sampling_bytes, shares_prompts, supported

__all__ = [
    "ARCHITECTURES",
    "Kept",
    "cache_dtype",
    "decode",
    "extend",
    "fuse_weights",
    "pack_single_matrices",
    "process",
    "sampling_bytes",
    "shares_prompts",
    "supported",
]
