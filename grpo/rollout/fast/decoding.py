"""The fast loop's loops: `decode` (a turn from the prompts) and `extend` (a turn from each row's
kept cache and its new tokens), and `supported`, which says whether a model can run them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from grpo.rollout.params import SamplingParams

from grpo.rollout.fast.draws import Segments, _draw, _inverse_cdf_draw, process
from grpo.rollout.fast.forward import _Cache, _forward, _Weights, cache_bytes, fuse_weights, out_features


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


def _weights_for(model, weights: _Weights | None, p: SamplingParams, dtype=None) -> _Weights:
    """The fused weights a call drawing by `p` runs on: `weights` where given and fit for its
    draw, else the model's fused now (packed for the fast draw). Packed weights serve the fast
    draw only: generate's bits need the plain layout. `dtype`: the compute dtype (default:
    the given weights', else the model's)."""
    if weights is not None and (p.fast_draw or not weights.packed):
        return weights
    if dtype is None:
        dtype = weights.embed.dtype if weights is not None else next(model.parameters()).dtype
    return fuse_weights(model, dtype, p.fast_draw)


# Where a decoding step's rows read their prompt's keys and values from one copy a prompt
# (`_Cache.share`) instead of a copy each (`_Cache.repeat`): where the copies beyond the
# first would hold at least this many bytes a layer. Reading a prompt once takes a few more
# ops a layer (the queries laid out a prompt at a time, and back), which cost more than the
# copies' reads save where those are small. `benchmarks/bench_shared_prefix.py` measures both
# ways over prompt lengths and rows on SmolLM2-135M: a copy a row wins on its shortest prompts,
# one copy a prompt from about this size up (benchmarks/README.md).
SHARE_FROM = 2 << 20


def shares_prompts(w: _Weights, p: SamplingParams, counts: Tensor, prompt_len: int, keep: bool = False) -> bool:
    """Whether a `decode` call's rows read their prompt's keys and values from one copy a
    prompt (`_Cache.share`) rather than each from its own (`_Cache.repeat`): for the fast
    draw, where the copies would hold SHARE_FROM bytes a layer or more (`prompt_len`
    positions for each row beyond a prompt's first), and where the rows' caches are not
    kept for another turn (`keep`, whose `Kept` holds each row's whole context). Never for
    generate's draw: its tokens are generate's bit for bit, and the shared attention's sums
    round differently. A decision by sizes, the same at every run of a config."""
    copies = int(counts.sum()) - int((counts > 0).sum())
    return p.fast_draw and not keep and copies > 0 and cache_bytes(w, copies * prompt_len) >= SHARE_FROM


def sampling_bytes(w: _Weights, prompts: int, prompt_len: int, rows: int, new_tokens: int, shared: bool = False) -> int:
    """About the most memory a `decode` call holds of its own: its KV caches (`shared`, as
    `shares_prompts` decides: the prompts' and the rows' own, `_Cache.share`; else the
    prefill's beside the rows' whole ones, `_Cache.repeat`), a few (rows, V) float32 tensors of logits and probabilities,
    and the prefill's widest activations (the MLP's, and the attention's). `prompts` prompts
    of `prompt_len` tokens (padded), `rows` completions of up to `new_tokens`. What
    `FastDecoder` leaves out of the room it may spend on packed weights."""
    total = prompt_len + new_tokens
    positions = prompts * prompt_len + rows * new_tokens if shared else (prompts + rows) * total
    cache = len(w.layers) * cache_bytes(w, positions)
    logits = 3 * rows * out_features(w.head) * 4
    mlp = out_features(w.layers[0].gate_up) if w.layers else 0
    prefill = prompts * prompt_len * (mlp + 4 * w.heads * w.head_dim) * 4
    return cache + logits + prefill


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
        w = _weights_for(model, weights, p, dtype)
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
        out = _extend(model, _weights_for(model, weights, p), kept, blocks, p, _segments(counts.cpu(), generators))
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
    shared = shares_prompts(w, p, counts, prompt_len, keep)
    cache = _Cache(w, b, prompt_len if shared else total)
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
        few_rows_layout=p.fast_draw,
    )

    # The G completions of a prompt continue from the same prefix: read from one copy
    # (`shares_prompts`), or each row given its own.
    if shared:
        cache.share(counts, prompt_len, p.max_new_tokens)
    else:
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
        w, ids, cos[positions][:, None], sin[positions][:, None], cache, width, mask, few_rows_layout=p.fast_draw
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
    rows' `Kept` cache is returned with the tokens (`_kept`). The prefill that gives `logits`
    is `_decode`'s (a prompt) or `_extend`'s (a kept context and its new turn)."""
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
    fast_draw = p.fast_draw
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
        # This step's (rows, V) logits and probabilities are done with: freed before the next
        # step's are made, not beside them (two vocabulary-wide tensors fewer at the peak).
        del probs
        logits = None
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
    kept = _kept(out, eos, filled, cache, held_rows, left_cache, start_valid, start_position)
    return out, out_logprobs, kept


def _kept(
    out: Tensor,
    eos: Tensor | None,
    filled: int,
    cache: _Cache,
    held_rows: Tensor,
    left_cache: list,
    start_valid: Tensor,
    start_position: Tensor,
) -> Kept:
    """The end of `_sample(keep=True)`: the rows' `Kept` cache, from the cache as the loop left
    it (`held_rows` the row of each of its rows) and the caches of the rows that left it before
    (`left_cache`), with each row's context before the loop (`start_valid`, `start_position`)."""
    device = out.device
    n, generated = out.shape
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
    return Kept(keys, values, torch.cat([start_valid, drawn], 1), start_position + in_cache)
