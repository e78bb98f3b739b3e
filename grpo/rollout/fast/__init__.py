"""A sampler's decoding loop for Llama-family models without `generate`'s per-token overhead.

GRPO pays for its baseline in generation: G completions per prompt, token by token. On a
CPU with a small model, `transformers`' `generate` spends most of each decoding step in
Python (cache objects, masks, logits processors, output dataclasses), not in arithmetic.
`decode` does the same computation with:
- one preallocated KV cache per call (no per-token `torch.cat` of the cache);
- each prompt's prefix computed once and shared by its G completions (the prefill runs on
  the distinct prompts; their cache rows are then repeated G times);
- the q/k/v and gate/up projections fused into one matmul each (`fuse_weights` concatenates them;
  `grpo.rollout.decoders.FastDecoder` does so once per policy version and passes them to
  every decoding call of that version);
- the rotary tables computed once per call by the model's own rotary module (so any RoPE
  scaling the model's config asks for is honoured);
- rows that have emitted EOS leave the loop: the LM head and the sampling processors run on
  the unfinished rows only, and the KV cache drops finished rows in batches (`COMPACT_AT`),
  so a batch whose completions end at very different lengths stops paying for the short ones.

For multi-turn rollouts, `decode(keep=True)` also returns each row's cache (`Kept`: its
keys and values, which slots hold its context, how many of its tokens), and `extend` goes
on from it with each row's new tokens (the end of its last turn, a tool's message): one
pass over those, then a turn sampled as `decode` samples it, without running the context
again. Rows that leave the loop early leave their cache behind for it.

It reproduces `generate`'s sampling exactly: float32 logits, the same processors in the same
order (`process`: repetition penalty, min_new_tokens suppressing EOS, temperature, top-k,
top-p, min-p, as transformers' `_get_logits_processor` lists them), `softmax` then
`torch.multinomial`'s draw over all rows every step (so the random stream is consumed
identically: on the CPU the unfinished rows' draws are computed as multinomial computes them,
and the finished rows' share of the stream is skipped at a fifth of the cost of drawing it,
`_draw`), padding after EOS, and stopping when every row has finished. From the same random
numbers it draws the same tokens as `generate` (tests/rollout/test_fast.py checks this, with
padding, groups, each sampling option alone and together, early EOS, and rows ending at very
different lengths, which leave the loop as they finish); the logits agree to float rounding.
It also returns what `generate` does not: each drawn token's log-prob under the distribution
it was drawn from (the probability the draw already computed, gathered).

Supported: `LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `MistralForCausalLM`
(SiLU MLP, RMSNorm, RoPE, grouped-query attention, optional q/k/v biases, Qwen3's per-head
q/k norms) without a sliding window shorter than
the sequence. Anything else (other architectures, a peft-wrapped policy) makes `supported`
return the reason, and the sampler falls back to `generate`.
"""

from grpo.rollout.fast.draws import process
from grpo.rollout.fast.forward import cache_dtype, fuse_weights
from grpo.rollout.fast.loop import ARCHITECTURES, Kept, decode, extend, supported

__all__ = ["ARCHITECTURES", "Kept", "cache_dtype", "decode", "extend", "fuse_weights", "process", "supported"]
