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

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from grpo.algo.logprobs import penalize
from grpo.rollout.params import SamplingParams

ARCHITECTURES = {"llama", "qwen2", "qwen3", "mistral"}

# When finished rows leave the KV cache: at a step where the finished rows still in the cache
# make up at least this fraction of the rows it holds, its unfinished rows are copied to the
# front and the rest dropped. Between copies, finished rows still run through the layers (their
# outputs unused) but never through the LM head or the processors. A copy moves only the
# surviving rows' filled prefix; at 1/4 a batch of N rows is copied O(log N) times, and the
# layers never run more than 4/3 of the rows still decoding. 0: copy at every step where a row
# finishes; 1: never copy. None: no row leaves the loop (every row runs to the end, as in
# generate; tests compare the two).
COMPACT_AT: float | None = 0.25

# On the CPU, a step's draw computes the unfinished rows' tokens and skips the finished rows'
# share of the random stream (`_draw`). False: one torch.multinomial over every row, as off
# the CPU (whose generators draw differently); tests run that path on the CPU with it.
SKIP_FINISHED_DRAWS = True


def supported(model, total_length: int) -> str | None:
    """None if `decode` can run `model` for sequences of `total_length` tokens, else why not."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in ARCHITECTURES:
        return f"model type {kind!r} (the fast sampler knows {', '.join(sorted(ARCHITECTURES))})"
    if not hasattr(model, "model") or not hasattr(model.model, "layers") or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} is not a plain causal LM (wrapped, e.g. by peft)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and window < total_length:
        return f"sliding window {window} < sequence length {total_length}"
    return None


@dataclass
class _Layer:
    norm_attn: Tensor
    qkv: Tensor  # (q + k + v outputs, H): the three projections stacked
    qkv_bias: Tensor | None
    out: Tensor
    out_bias: Tensor | None
    norm_mlp: Tensor
    gate_up: Tensor  # (2 * I, H)
    gate_up_bias: Tensor | None
    down: Tensor
    down_bias: Tensor | None
    q_norm: Tensor | None = None  # Qwen3: RMSNorm over each query head (carrying the 1/sqrt(D))
    k_norm: Tensor | None = None  # Qwen3: RMSNorm over each key head


@dataclass
class _Weights:
    embed: Tensor
    layers: list[_Layer]
    norm: Tensor
    head: Tensor
    head_bias: Tensor | None
    eps: float
    heads: int
    kv_heads: int
    head_dim: int


def _stack(linears, dtype, scales=None) -> tuple[Tensor, Tensor | None]:
    """The weights of `linears` stacked along the output dimension (linear j's scaled by
    scales[j]), in `dtype`, and their biases likewise (zeros for one without; None if none has)."""
    scales = scales or [1.0] * len(linears)

    def scaled(t: Tensor, scale: float) -> Tensor:
        return t.detach() * scale if scale != 1.0 else t.detach()

    def joined(tensors: list[Tensor]) -> Tensor:  # no copy for a single tensor already in dtype
        return (tensors[0] if len(tensors) == 1 else torch.cat(tensors)).to(dtype)

    weight = joined([scaled(lin.weight, sc) for lin, sc in zip(linears, scales)])
    if all(lin.bias is None for lin in linears):
        return weight, None
    return weight, joined(
        [
            scaled(lin.bias, sc) if lin.bias is not None else lin.weight.new_zeros(lin.out_features)
            for lin, sc in zip(linears, scales)
        ]
    )


def fuse_weights(model, dtype: torch.dtype) -> _Weights:
    """The model's current weights, in `dtype`, with the fused projections built."""
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        # The attention's 1/sqrt(D) is folded into the query projection (RoPE is linear, so
        # rotating the scaled query scales the rotated one): one op fewer per layer and step.
        # With Qwen3's per-head query norm, which would undo that scale, it goes into the norm's weight.
        scale = getattr(a, "scaling", None) or head_dim**-0.5
        q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        q_scale = 1.0 if q_norm is not None else scale
        qkv, qkv_bias = _stack([a.q_proj, a.k_proj, a.v_proj], dtype, [q_scale, 1.0, 1.0])  # Qwen2 has q/k/v biases
        out, out_bias = _stack([a.o_proj], dtype)
        gate_up, gate_up_bias = _stack([m.gate_proj, m.up_proj], dtype)
        down, down_bias = _stack([m.down_proj], dtype)
        layers.append(
            _Layer(
                norm_attn=layer.input_layernorm.weight.detach().to(dtype),
                qkv=qkv,
                qkv_bias=qkv_bias,
                out=out,
                out_bias=out_bias,
                norm_mlp=layer.post_attention_layernorm.weight.detach().to(dtype),
                gate_up=gate_up,
                gate_up_bias=gate_up_bias,
                down=down,
                down_bias=down_bias,
                q_norm=None if q_norm is None else (q_norm.weight.detach() * scale).to(dtype),
                k_norm=None if k_norm is None else k_norm.weight.detach().to(dtype),
            )
        )
    head, head_bias = _stack([model.lm_head], dtype)
    return _Weights(
        embed=model.model.embed_tokens.weight.detach().to(dtype),
        layers=layers,
        norm=model.model.norm.weight.detach().to(dtype),
        head=head,
        head_bias=head_bias,
        eps=getattr(model.model.norm, "variance_epsilon", None) or config.rms_norm_eps,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
    )


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """LlamaRMSNorm (x / sqrt(mean(x^2) + eps) * weight) as one fused op."""
    return F.rms_norm(x, weight.shape, weight, eps)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE as Llama applies it: x * cos + rotate_half(x) * sin (cos, sin: (B, 1, S, D))."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


def cache_dtype(w: _Weights) -> torch.dtype:
    """The KV cache's dtype: float32 on a CPU (its per-length matmuls then use float32 kernels;
    bf16 ones JIT one kernel per shape, which costs memory: benchmarks/README.md); on a GPU
    the compute dtype (bf16 halves the cache, and the GPU's kernels take any shape)."""
    return torch.float32 if w.embed.device.type == "cpu" else w.embed.dtype


class _Cache:
    """Preallocated keys and values: (layers, B, kv_heads, length, head_dim) each, in `cache_dtype`."""

    def __init__(self, w: _Weights, rows: int, length: int):
        shape = (len(w.layers), rows, w.kv_heads, length, w.head_dim)
        self.keys = torch.empty(shape, device=w.embed.device, dtype=cache_dtype(w))
        self.values = torch.empty_like(self.keys)

    def repeat(self, counts: Tensor, filled: int) -> None:
        """Repeat cache row i counts[i] times (the G completions of a prompt share its prefix)."""
        rows = int(counts.sum())
        keys = self.keys.new_empty(self.keys.shape[:1] + (rows,) + self.keys.shape[2:])
        values = torch.empty_like(keys)
        keys[:, :, :, :filled] = self.keys[:, :, :, :filled].repeat_interleave(counts, 1)
        values[:, :, :, :filled] = self.values[:, :, :, :filled].repeat_interleave(counts, 1)
        self.keys, self.values = keys, values

    def keep(self, rows: Tensor, filled: int) -> None:
        """Keep cache rows `rows` only (in that order), moved to the front of the same buffers
        (their first `filled` positions): no second cache is allocated."""
        k = len(rows)
        self.keys[:, :k, :, :filled] = self.keys[:, rows, :, :filled]
        self.values[:, :k, :, :filled] = self.values[:, rows, :, :filled]
        self.keys, self.values = self.keys[:, :k], self.values[:, :k]


def _attend_one(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    """Attention of one new query per row over the cache: (B, heads, 1, D). Two batched
    matmuls; for a single query this is several times faster on a CPU than the fused
    scaled_dot_product_attention kernel. Grouped-query heads share their key/value head."""
    b, heads, _, d = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    q = q.reshape(b, kv_heads, heads // kv_heads, d)  # the query heads of each key/value head
    scores = torch.matmul(q, keys.transpose(-1, -2))  # (B, kv_heads, group, L); q carries the 1/sqrt(D)
    if mask is not None:
        scores = scores.masked_fill(~mask.view(b, 1, 1, length), -math.inf)
    weights = torch.softmax(scores, -1, dtype=torch.float32).to(values.dtype)
    return torch.matmul(weights, values).view(b, heads, 1, d)


def _forward(
    w: _Weights,
    ids: Tensor,
    cos: Tensor,
    sin: Tensor,
    cache: _Cache,
    start: int,
    mask: Tensor | None,
    heads: Tensor | None = None,
    few_rows_layout: bool = False,
) -> Tensor:
    """Run tokens `ids` (B, S) at cache positions start..start+S-1; the last position's logits
    (B, V), or with `heads` (indices into the B rows) those rows' logits only (len(heads), V).
    `few_rows_layout`: the matmuls in the layout fastest for a few rows (`_linear`; rollout.draw: fast)."""
    b, s = ids.shape
    q_width, kv_width = w.heads * w.head_dim, w.kv_heads * w.head_dim
    end = start + s
    gqa = w.kv_heads != w.heads
    h = F.embedding(ids, w.embed)  # (B, S, H)
    for i, layer in enumerate(w.layers):
        x = _rms_norm(h, layer.norm_attn, w.eps)
        qkv = _linear(x, layer.qkv, layer.qkv_bias, few_rows_layout)  # (B, S, q + 2 kv), q already scaled by 1/sqrt(D)
        # RoPE in float32 whatever the weights' dtype (more accurate in bf16); attention in the
        # cache's dtype (`cache_dtype`: float32 on a CPU, the compute dtype on a GPU).
        qk = qkv[..., : q_width + kv_width].view(b, s, w.heads + w.kv_heads, w.head_dim)
        if layer.q_norm is not None:
            qk = torch.cat(
                [
                    _rms_norm(qk[:, :, : w.heads], layer.q_norm, w.eps),
                    _rms_norm(qk[:, :, w.heads :], layer.k_norm, w.eps),
                ],
                2,
            )
        qk = _rotate(qk.transpose(1, 2).float(), cos, sin)
        q, k = qk[:, : w.heads].to(cache.keys.dtype), qk[:, w.heads :]  # (B, heads, S, D), (B, kv_heads, S, D)
        v = qkv[..., q_width + kv_width :].view(b, s, w.kv_heads, w.head_dim).transpose(1, 2)
        keys, values = cache.keys[i], cache.values[i]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        if s == 1:
            attn = _attend_one(q, keys[:, :, :end], values[:, :, :end], mask)
        else:
            attn = F.scaled_dot_product_attention(
                q, keys[:, :, :end], values[:, :, :end], attn_mask=mask, enable_gqa=gqa, scale=1.0
            )  # (B, heads, S, D)
        h = h + _linear(
            attn.transpose(1, 2).reshape(b, s, q_width).to(h.dtype), layer.out, layer.out_bias, few_rows_layout
        )
        x = _rms_norm(h, layer.norm_mlp, w.eps)
        gate, up = _linear(x, layer.gate_up, layer.gate_up_bias, few_rows_layout).chunk(2, -1)
        h = h + _linear(F.silu(gate) * up, layer.down, layer.down_bias, few_rows_layout)
    last = h[:, -1] if heads is None else h[heads, -1]
    return _linear(_rms_norm(last, w.norm, w.eps), w.head, w.head_bias, few_rows_layout)  # (B or len(heads), V)


# Below this many rows, rollout.draw: fast computes each matmul of the loop as W @ x^T. On a
# CPU, MKL runs x @ W^T (F.linear) for a few rows several times slower than W @ x^T when the
# weights come from memory, not from cache: ~30 ms against 5-10 ms for 2-8 rows of a
# 151,936 x 256 head; SmolLM2's 30 layers for one token, 46 against 37 ms at 8 rows, 62
# against 16 at 2; its 49,152 x 576 head, 19.6 against 8.5 ms at 8 rows (2026-12-02,
# AVX-512 EPYC, 2 threads). From about 12 rows up both take the same kernel, and the same
# time. The two differ in float rounding, so not under rollout.draw: generate, whose tokens
# are generate's bit for bit.
FEW_ROWS = 12


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None, few_rows_layout: bool) -> Tensor:
    """F.linear(x, weight, bias), as W @ x^T where `few_rows_layout` and x has fewer than
    FEW_ROWS rows (all dimensions but the last) on a CPU."""
    rows = x.numel() // x.shape[-1]
    if not (few_rows_layout and rows < FEW_ROWS and x.device.type == "cpu"):
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.reshape(rows, x.shape[-1]).T).T.contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


def process(logits: Tensor, step: int, p: SamplingParams, eos: Tensor | None, seen: Tensor | None = None) -> Tensor:
    """generate's logits processors for one step, in generate's order: (B, V) float32 logits
    -> the scores it samples from (softmax of them). `seen` (B, V) bool marks the tokens of
    each row's sequence so far, prompt included (used when repetition_penalty != 1)."""
    scores = logits
    if p.repetition_penalty != 1.0:
        scores = penalize(scores, seen, p.repetition_penalty)
    if eos is not None and step < p.min_new_tokens:
        scores = scores.index_fill(1, eos, -math.inf)
    if p.temperature != 1.0:
        scores = scores / p.temperature
    if p.top_k:
        top_k = min(p.top_k, scores.shape[-1])
        scores = scores.masked_fill(scores < torch.topk(scores, top_k)[0][..., -1, None], -math.inf)
    if p.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        remove = sorted_scores.softmax(-1).cumsum(-1) <= (1 - p.top_p)
        remove[..., -1:] = False  # keep at least one token
        scores = scores.masked_fill(remove.scatter(1, order, remove), -math.inf)
    if p.min_p > 0.0:  # after temperature and top-p, relative to the most likely token's probability
        probs = scores.softmax(-1)
        # The most likely token always passes (min_p < 1), so at least one token is kept.
        scores = scores.masked_fill(probs < p.min_p * probs.amax(-1, keepdim=True), -math.inf)
    return scores


_LOW_53 = (1 << 53) - 1  # the bits of a 64-bit draw that make a float64 uniform


def _skip(count: int, generator: torch.Generator | None) -> None:
    """Advance the CPU generator past `count` exponential draws without making them: on the
    CPU, Tensor.exponential_ takes one 64-bit number per element from the generator (and
    nothing else), as int64 random_ does, at a fifth of the cost (no logarithm)."""
    if count:
        torch.empty(count, dtype=torch.int64).random_(generator=generator)


def _exponential_argmax(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """(k,) argmax_v probs[:, v] / q_v with q ~ Exp(1): torch.multinomial's one-sample draw
    on the CPU (q = Tensor.exponential_ over the (k, V) probabilities, then argmax(p / q)),
    number for number, with the logarithm vectorised. exponential_ takes u = the low 53
    bits of one 64-bit draw / 2**53 per element and returns float32(-log1p(-u)) (`_exponential`;
    checked bit for bit against it, tests/rollout/test_fast.py)."""
    return probs.div(_exponential(probs.shape, generator)).argmax(-1)


def _exponential(shape, generator: torch.Generator | None) -> Tensor:
    """torch.empty(shape).exponential_(generator=generator), float32, computed vectorised."""
    bits = torch.empty(shape, dtype=torch.int64).random_(generator=generator)
    u = bits.bitwise_and_(_LOW_53).to(torch.float64).mul_(2.0**-53)
    return u.neg_().log1p_().mul_(-1.0).to(torch.float32)  # -1 * log1p(-u): +0.0 at u = 0, as exponential_


def _cpu_draw(probs: Tensor, rows: list[int], start: int, stop: int, generator: torch.Generator | None) -> list[Tensor]:
    """The tokens of the unfinished `rows` (ascending, in start..stop-1; `probs` (len(rows), V)
    their distributions) drawn as one multinomial over rows start..stop-1 draws them: runs of
    unfinished rows are drawn, the finished rows between them skipped."""
    vocab, out, at, i = probs.shape[1], [], start, 0
    while i < len(rows):
        j = i
        while j + 1 < len(rows) and rows[j + 1] == rows[j] + 1:
            j += 1
        _skip((rows[i] - at) * vocab, generator)
        out.append(_exponential_argmax(probs[i : j + 1], generator))
        at, i = rows[j] + 1, j + 1
    _skip((stop - at) * vocab, generator)
    return out


_CDF_BLOCK = 128  # vocabulary entries per block of the two-level lookup (`_inverse_cdf_draw`)


def _inverse_cdf_draw(probs: Tensor, rows: Tensor, segments: Segments) -> Tensor:
    """rollout.draw: fast. The (L,) tokens of the unfinished `rows` (ascending; `probs`
    (L, V) their distributions, softmax outputs, not necessarily normalised), each drawn by
    inverting its cumulative distribution at one float64 uniform u: token v is drawn when
    cdf[v - 1] <= u * total < cdf[v], a probability of p_v / total up to float64 rounding.
    Each segment's generator gives one uniform per row it covers, finished rows included, so
    a row's draw does not depend on which others have ended.

    The lookup has two levels, so that no running sum goes over the whole vocabulary (a
    cumulative sum is a serial loop, ~5 ns an entry): the float64 sums of blocks of
    `_CDF_BLOCK` entries (one vectorised pass), their cumulative sum, the block u falls in,
    then the cumulative sum inside that block alone. One pass over each row's probabilities
    where multinomial's draw takes an exponential per vocabulary entry. Other tokens than
    `generate` draws, from the same distribution."""
    n, vocab = probs.shape
    width = -(-vocab // _CDF_BLOCK) * _CDF_BLOCK
    blocks = (F.pad(probs, (0, width - vocab)) if width != vocab else probs).view(n, -1, _CDF_BLOCK)
    cdf = blocks.sum(-1, dtype=torch.float64).cumsum_(-1)  # (L, blocks)
    total = cdf[:, -1]
    if not bool((torch.isfinite(total) & (total > 0)).all()):  # what torch.multinomial refuses; one sync a step
        if not bool(torch.isfinite(total).all()):
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
    uniforms = [
        torch.rand(stop - start, dtype=torch.float64, generator=g, device=probs.device) for start, stop, g in segments
    ]
    u = torch.cat(uniforms)[rows]  # (L,) the unfinished rows' own
    below = lambda x: torch.nextafter(x, torch.zeros_like(x))  # noqa: E731
    # Kept below the last cumulative value, so that the entry found has a probability > 0
    # (cdf[v] > target >= cdf[v - 1]); float64 rounding of a sum taken two ways could
    # otherwise put it one past the end.
    target = torch.minimum(u * total, below(total))
    block = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)  # (L,)
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    inside = blocks[torch.arange(n, device=probs.device), block].to(torch.float64).cumsum_(-1)  # (L, _CDF_BLOCK)
    rest = torch.minimum(target - before, below(inside[:, -1]))
    return block * _CDF_BLOCK + torch.searchsorted(inside, rest[:, None], right=True).squeeze(1)


# Where a step's draw takes its random numbers: (first row, row past the last, generator) per
# stretch of rows: one for every row (from its generator; None: the global stream), or one per prompt.
Segments = list[tuple[int, int, "torch.Generator | None"]]


def _draw(probs: Tensor, rows: Tensor, segments: Segments, everyone: Tensor | None = None) -> Tensor:
    """generate's draw for one step: the (L, V) probabilities of the unfinished `rows`
    (ascending, of the n rows that `segments` cover) -> their (L,) tokens, as one
    `torch.multinomial` over all n rows would draw them (generate's draw covers finished rows
    too, and the random numbers a draw takes depend on its shape), each segment's rows from
    its generator.

    Without `everyone` (the CPU), finished rows cost a skip of the stream, not a draw
    (`_cpu_draw`). With it ((n, V): the rows' last distributions, updated here), the
    multinomial runs over every row, as off the CPU."""
    if everyone is None:
        if not bool(torch.isfinite(probs).all()):  # what torch.multinomial refuses
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        live, parts, i = rows.tolist(), [], 0
        for start, stop, generator in segments:
            j = bisect.bisect_left(live, stop, lo=i)  # this segment's unfinished rows: live[i:j]
            parts += _cpu_draw(probs[i:j], live[i:j], start, stop, generator)
            i = j
        return torch.cat(parts)
    everyone.index_copy_(0, rows, probs)
    return torch.cat([torch.multinomial(everyone[a:b], 1, generator=g) for a, b, g in segments]).squeeze(1)[rows]


@dataclass
class Kept:
    """What a decoding call leaves for its rows' next turn (`decode(keep=True)`, `extend`):
    their keys and values, which cache slots hold their context, and how many tokens of it
    each row's cache holds (so its next RoPE position). A slot that holds no context (a
    prompt's left padding, the padding a finished row ran through, a shorter block's left
    padding) is masked out, never read; each key carries its RoPE position, so the slots of
    a row need not be contiguous."""

    keys: Tensor  # (layers, R, kv_heads, W, head_dim)
    values: Tensor  # the same
    valid: Tensor  # (R, W) bool: the slot holds a token of the row's context
    cached: Tensor  # (R,) long: the row's context tokens in the cache (its first `cached`)

    def select(self, rows: Sequence[int]) -> Kept:
        rows = list(rows)
        if rows == list(range(len(self.cached))):
            return self
        index = torch.tensor(rows, dtype=torch.long, device=self.valid.device)
        return Kept(self.keys[:, index], self.values[:, index], self.valid[index], self.cached[index])

    @staticmethod
    def join(parts: Sequence[Kept]) -> Kept:
        """The rows of `parts`, in order, in one cache as wide as the widest (the others'
        rows padded with masked slots)."""
        if len(parts) == 1:
            return parts[0]
        width = max(part.valid.shape[1] for part in parts)
        return Kept(
            torch.cat([_widen(part.keys, 3, width) for part in parts], 1),
            torch.cat([_widen(part.values, 3, width) for part in parts], 1),
            torch.cat([_widen(part.valid, 1, width, False) for part in parts], 0),
            torch.cat([part.cached for part in parts], 0),
        )


def _widen(t: Tensor, dim: int, width: int, value=0.0) -> Tensor:
    """`t` padded at the end of `dim` with `value` to `width` (cache slots: masked, never read)."""
    return F.pad(t, [0, 0] * (t.dim() - 1 - dim) + [0, width - t.shape[dim]], value=value)


def _segments(counts: Tensor, generators: Sequence[torch.Generator | None] | None) -> Segments:
    n = int(counts.sum())
    generators = [None] if generators is None else list(generators)
    if len(generators) == 1:
        return [(0, n, generators[0])]
    if len(generators) != len(counts):
        raise ValueError(f"{len(generators)} generators for {len(counts)} prompts")
    starts = [0, *counts.cumsum(0).tolist()]
    return list(zip(starts, starts[1:], generators))


def decode(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    counts: Tensor,
    p: SamplingParams,
    dtype=None,
    weights: _Weights | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    keep: bool = False,
):
    """Sample completions: prompt i (a row of the left-padded `prompt_ids` (B, P)) gets
    counts[i] consecutive rows. Returns (sum(counts), T) token ids, T <= max_new_tokens,
    padded with `pad_token_id` after each row's EOS, and (sum(counts), T) float32: the
    log-prob of each token drawn under the distribution it was drawn from (after the
    processors), 0 after EOS. `dtype` is the compute dtype (default: the model's); `weights`
    are the model's current fused weights from `fuse_weights(model, dtype)` (default: built
    for this call). `generators`: one for every row, or one per prompt (prompt i's rows drawn
    from generators[i], so that its completions do not depend on the other prompts of the
    call); None (or a None in place of the one): the global stream, as `generate` draws.
    With `keep`, a third result: the rows' `Kept` cache, for `extend` to continue each row
    after more tokens (a multi-turn rollout's next turn); no row then leaves the cache early
    (the tokens drawn are the same either way, `COMPACT_AT`)."""
    # inference_mode skips autograd's per-op bookkeeping; its tensors cannot enter autograd
    # later, so the result is copied out of it.
    with torch.inference_mode():
        w = weights if weights is not None else fuse_weights(model, dtype or next(model.parameters()).dtype)
        ids, logprobs, kept = _decode(model, w, prompt_ids, prompt_mask, counts, p, _segments(counts, generators), keep)
    if not keep:
        return ids.clone(), logprobs.clone()
    return ids.clone(), logprobs.clone(), kept


def extend(
    model,
    kept: Kept,
    blocks: Sequence[Sequence[int]],
    p: SamplingParams,
    weights: _Weights,
    counts: Tensor,
    generators: Sequence[torch.Generator | None] | None = None,
) -> tuple[Tensor, Tensor, Kept]:
    """`decode` for rows whose context a `Kept` cache holds the start of: row i's context
    goes on with `blocks[i]` (its tokens the cache does not hold: the end of its last turn,
    the tool messages), run in one pass; then a turn is sampled as `decode` samples it (the
    same tokens as `decode` on the whole context, the log-probs within float rounding).
    `counts` and `generators` say where each row draws its random numbers, as `decode`'s
    do (consecutive rows in one segment of the draw: a prompt's rows with the same context,
    as `decode` would get them). Returns `decode(keep=True)`'s three."""
    with torch.inference_mode():
        out = _extend(model, weights, kept, blocks, p, _segments(counts.cpu(), generators))
    ids, logprobs, kept = out
    return ids.clone(), logprobs.clone(), kept


def _rope(model, w: _Weights, length: int, device) -> tuple[Tensor, Tensor]:
    """The rotary tables for positions 0..length-1, (length, D) float32, by the model's own module."""
    cos, sin = model.model.rotary_emb(w.embed[:1], torch.arange(length, device=device)[None])  # (1, length, D)
    return cos[0].float(), sin[0].float()


def _decode(
    model,
    w: _Weights,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    counts: Tensor,
    p: SamplingParams,
    segments: Segments,
    keep: bool = False,
) -> tuple[Tensor, Tensor, Kept | None]:
    b, prompt_len = prompt_ids.shape
    total = prompt_len + p.max_new_tokens
    device = prompt_ids.device

    # Positions as generate gives them to a left-padded batch: counting from each row's first token.
    positions = (prompt_mask.long().cumsum(1) - 1).clamp(min=0)  # (B, P)
    cos, sin = _rope(model, w, total, device)

    # Prefill once per distinct prompt. Padding keys are masked out; a padding query attends
    # to itself (its output is never used) so that no row of the mask is empty.
    valid = prompt_mask.bool()  # (B, P)
    cache = _Cache(w, b, total)
    causal = torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=device).tril()
    mask = (causal & (valid[:, None, :] | torch.eye(prompt_len, dtype=torch.bool, device=device)))[:, None]
    logits = _forward(
        w,
        prompt_ids,
        cos[positions][:, None],
        sin[positions][:, None],
        cache,
        0,
        mask,
        few_rows_layout=p.draw == "fast",
    )

    # The G completions of a prompt continue from the same prefix.
    cache.repeat(counts, prompt_len)
    logits = logits.repeat_interleave(counts, 0).float()  # (N, V)
    valid = valid.repeat_interleave(counts, 0)
    next_position = prompt_mask.long().sum(1).repeat_interleave(counts, 0)  # (N,)

    # The repetition penalty's tokens: as generate counts them, every token of the prompt
    # but its padding, then each token drawn (a finished row's padding too; its draws are discarded).
    seen = None
    if p.repetition_penalty != 1.0:
        vocab = logits.shape[-1]
        seen = torch.zeros(b, vocab + 1, dtype=torch.bool, device=device)  # column `vocab` takes the padding
        seen.scatter_(1, prompt_ids.masked_fill(~prompt_mask.bool(), vocab), True)
        seen = seen[:, :vocab].repeat_interleave(counts, 0)  # (N, V)
    return _sample(w, cache, logits, cos, sin, valid, next_position, prompt_len, p, segments, seen, keep)


def _extend(
    model, w: _Weights, kept: Kept, blocks: Sequence[Sequence[int]], p: SamplingParams, segments: Segments
) -> tuple[Tensor, Tensor, Kept]:
    device = kept.valid.device
    r, width = kept.valid.shape
    lengths = torch.tensor([len(block) for block in blocks], dtype=torch.long, device=device)  # (R,)
    s = int(lengths.max())
    # The blocks right-aligned in (R, S), so that every row's last token is in the last column.
    ids = torch.full((r, s), p.pad_token_id, dtype=torch.long, device=device)
    for i, block in enumerate(blocks):
        ids[i, s - len(block) :] = torch.tensor(list(block), dtype=torch.long, device=device)
    fresh = torch.arange(s, device=device)[None] >= (s - lengths)[:, None]  # (R, S): a block token
    positions = (kept.cached[:, None] + fresh.long().cumsum(1) - 1).clamp(min=0)  # (R, S)
    cos, sin = _rope(model, w, int(kept.cached.max()) + s + p.max_new_tokens, device)

    cache = _Cache(w, r, width + s + p.max_new_tokens)
    cache.keys[:, :, :, :width] = kept.keys
    cache.values[:, :, :, :width] = kept.values
    # The block attends to the row's cached context and, causally, to its own tokens; a padding
    # query attends to itself too (its output is never used), so that no row of the mask is empty.
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    own = causal & (fresh[:, None, :] | torch.eye(s, dtype=torch.bool, device=device))  # (R, S, S)
    mask = torch.cat([kept.valid[:, None, :].expand(r, s, width), own], 2)[:, None]  # (R, 1, S, W + S)
    logits = _forward(
        w, ids, cos[positions][:, None], sin[positions][:, None], cache, width, mask, few_rows_layout=p.draw == "fast"
    ).float()
    valid = torch.cat([kept.valid, fresh], 1)  # (R, W + S)
    return _sample(w, cache, logits, cos, sin, valid, kept.cached + lengths, width + s, p, segments, None, True)


def _sample(
    w: _Weights,
    cache: _Cache,
    logits: Tensor,
    cos: Tensor,
    sin: Tensor,
    valid: Tensor,
    next_position: Tensor,
    filled: int,
    p: SamplingParams,
    segments: Segments,
    seen: Tensor | None,
    keep: bool,
) -> tuple[Tensor, Tensor, Kept | None]:
    """The decoding loop, from each row's next-token `logits` (N, V) with its context in the
    cache's first `filled` slots (`valid` (N, filled) says which hold it; `next_position`
    (N,) is each row's next RoPE position). With `keep`, no row leaves the cache, and the
    rows' `Kept` cache is returned with the tokens."""
    device = logits.device
    n = logits.shape[0]
    padded = not bool(valid.all())
    valid = torch.cat([valid, torch.ones(n, p.max_new_tokens, dtype=torch.bool, device=device)], 1)
    eos = torch.tensor(p.eos_token_ids, dtype=torch.long, device=device) if p.eos_token_ids else None
    out = torch.full((n, p.max_new_tokens), p.pad_token_id, dtype=torch.long, device=device)
    out_logprobs = torch.zeros(n, p.max_new_tokens, device=device)  # (N, T) of the tokens drawn
    # Which rows go where. `rows` (original indices, ascending): the rows that get logits,
    # processors and a token of their own; `logits`, `seen` and `unfinished` are aligned to it.
    # Without compaction every row, to the end (a finished row's token becomes padding, as in
    # generate); with it, the unfinished rows. The cache holds `held` rows, a superset of
    # `rows` (finished rows wait there for the next copy, `COMPACT_AT`); `pick` says where
    # each of `rows` sits in it (None: the cache holds exactly `rows`).
    compact = COMPACT_AT is not None and eos is not None
    # With `keep`: each cache row's row (`held_rows`), and the caches of rows that left it
    # (row ids, keys, values, slots filled), for the rows' Kept cache at the end.
    start_valid, start_position = valid[:, :filled], next_position
    held_rows, left_cache = torch.arange(n, device=device), []
    rows = torch.arange(n, device=device)
    unfinished = torch.ones(n, dtype=torch.bool, device=device)
    held, pick = n, None
    # (N, V) off the CPU (or with SKIP_FINISHED_DRAWS off): each row's last distribution, for
    # a draw over all rows; None: the finished rows' draws are skipped (`_draw`).
    fast_draw = p.draw == "fast"
    full_batch = (device.type != "cpu" or not SKIP_FINISHED_DRAWS) and not fast_draw
    everyone = None
    generated = 0
    for step in range(p.max_new_tokens):
        probs = F.softmax(process(logits, step, p, eos, seen), dim=-1)
        if full_batch and everyone is None:
            everyone = probs.clone()
        tokens = _inverse_cdf_draw(probs, rows, segments) if fast_draw else _draw(probs, rows, segments, everyone)
        # The drawn token's probability, already computed: a gather, no pass over the vocabulary.
        logprobs = probs.gather(1, tokens[:, None]).squeeze(1).log_()  # (len(rows),)
        if eos is not None:
            logprobs = logprobs.masked_fill_(~unfinished, 0.0)
            tokens = torch.where(unfinished, tokens, p.pad_token_id)
            unfinished &= ~torch.isin(tokens, eos)
        if seen is not None:
            seen[torch.arange(len(rows), device=device), tokens] = True
        out[rows, step] = tokens
        out_logprobs[rows, step] = logprobs
        generated = step + 1
        left = int(unfinished.sum()) if eos is not None else len(rows)  # one host sync per step
        if generated == p.max_new_tokens or left == 0:
            break
        at = filled + step  # the cache's filled length; this step's token goes there
        if compact and left < len(rows):
            alive = unfinished.nonzero().squeeze(1)
            rows, tokens, unfinished = rows[alive], tokens[alive], unfinished[alive]
            seen = seen[alive] if seen is not None else None
            pick = alive if pick is None else pick[alive]
            if held - len(rows) >= COMPACT_AT * held:
                if keep:
                    gone = torch.ones(held, dtype=torch.bool, device=device).index_fill_(0, pick, False)
                    gone = gone.nonzero().squeeze(1)
                    left_cache.append((held_rows[gone], cache.keys[:, gone, :, :at], cache.values[:, gone, :, :at], at))
                    held_rows = held_rows[pick]
                cache.keep(pick, at)
                next_position, valid = next_position[pick], valid[pick]
                padded = not bool(valid[:, :filled].all())
                held, pick = len(rows), None
        if pick is not None:  # finished rows still in the cache get padding (their outputs are not used)
            tokens = tokens.new_full((held,), p.pad_token_id).index_copy_(0, pick, tokens)
        position = next_position + step  # (held,)
        step_mask = valid[:, None, None, : at + 1] if padded else None
        logits = _forward(
            w,
            tokens[:, None],
            cos[position][:, None, None],
            sin[position][:, None, None],
            cache,
            at,
            step_mask,
            heads=pick,
            few_rows_layout=fast_draw,
        ).float()
    out, out_logprobs = out[:, :generated], out_logprobs[:, :generated]
    if not keep:
        return out, out_logprobs, None
    # The rows' context in the cache: their prompt, then the tokens each ran through before
    # the loop ended or the row left the cache (the last step's tokens never run). A row's own
    # tokens end at its EOS; the EOS itself is left to the next turn (a row that finishes may
    # run padding in its place), as is anything after it (padding: masked out).
    lengths = torch.full((n,), generated, dtype=torch.long, device=device)
    if eos is not None:
        ended = torch.isin(out, eos)
        lengths = torch.where(ended.any(1), ended.long().argmax(1), lengths)
    width = filled + generated - 1
    if not left_cache:  # every row is where it started: the cache as it is, no copy
        keys, values = cache.keys[:, :, :, :width], cache.values[:, :, :, :width]
        ran = torch.full_like(lengths, generated - 1)  # (N,) each row's drawn tokens run through the cache
    else:  # the rows that left, back in their places, each cache widened to the last's slots
        parts = [*left_cache, (held_rows, cache.keys, cache.values, width)]
        order = torch.cat([rows for rows, _, _, _ in parts])  # the row of each part's rows, in turn
        back = torch.empty_like(order).index_copy_(0, order, torch.arange(n, device=device))  # row -> its place
        keys = torch.cat([_widen(k[:, :, :, :slots], 3, width) for _, k, _, slots in parts], 1)[:, back]
        values = torch.cat([_widen(v[:, :, :, :slots], 3, width) for _, _, v, slots in parts], 1)[:, back]
        ran = torch.cat([torch.full_like(rows, slots - filled) for rows, _, _, slots in parts])[back]
    in_cache = torch.minimum(lengths, ran)  # (N,) the row's drawn tokens its cache holds
    drawn = torch.arange(generated - 1, device=device)[None] < in_cache[:, None]  # (N, generated - 1)
    return out, out_logprobs, Kept(keys, values, torch.cat([start_valid, drawn], 1), start_position + in_cache)
