"""Log-probabilities and entropy of sampled tokens, without a full-vocabulary float32 copy.

`log_softmax(logits.float(), -1).gather(-1, ids)` materialises an (N, T, V) float32 tensor,
kept for the backward pass (4 bytes for every vocabulary entry of every token). Here
each chunk of rows is upcast, reduced to one log-sum-exp per token and dropped, and the
backward recomputes it; results are float32 whatever the logits' dtype. A repetition penalty
(`penalize`) applies at position t to the tokens before t, as the sampler applied it.
`head_logprobs` starts from the LM head's input and weight, so that no (N, T, V) tensor
exists at all; both paths share the per-chunk code (`_scores`, `_chunk_grad`). In float32 it
also tiles the vocabulary: a chunk's logits over VOCAB_TILE columns at a time, the
log-sum-exp carried from tile to tile (`_Online`), so that each tile's scores are reduced
while they are in the cache and the head's weight is read once per chunk of rows, not once
per few rows (a large vocabulary's head pass is the faster for it on a CPU: benchmarks/README.md).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

__all__ = ["token_logprobs", "entropy", "head_logprobs", "penalize"]

# Elements of float32 scratch per chunk: 2**24, four bytes each.
_CHUNK_ELEMENTS = 1 << 24
# Columns of the vocabulary a chunk's float32 logits are computed over at a time (head_logprobs).
VOCAB_TILE = 2048


def _rows_per_chunk(vocab: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // max(vocab, 1))


def penalize(scores: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """The repetition penalty (CTRL, Keskar et al. 2019) as transformers' generate applies it:
    the score of each token marked in `seen` (bool, the shape of `scores`: the tokens already
    in the sequence) is divided by `penalty` where it is >= 0 and multiplied by it where it is
    < 0, so that a penalty > 1 makes a repeat less likely whatever its sign. The sampler and
    the loss both call this one function, so they compute the same numbers."""
    return torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)


class _History:
    """The tokens before each position, for the repetition penalty: `context` (N, P) long (the
    prompt; negative = padding, not counted) and `ids` (N, T), position (n, t) having seen
    context[n] and ids[n, :t]. Positions are the rows of the flattened (N * T, V) logits."""

    def __init__(self, context: Tensor, ids: Tensor, vocab: int, positions: Tensor | None = None):
        self.vocab = vocab
        self.positions = positions  # (M,) the flat positions the rows are, when not all of them in order
        self.t_len = ids.shape[1]
        self.context = context.long().masked_fill(context < 0, vocab)  # (N, P); padding -> the spare column
        self.ids = ids.long()  # (N, T)
        self.width = max(vocab + 1, context.shape[1] + self.t_len)  # elements per row of a chunk's scratch

    def seen(self, start: int, stop: int) -> Tensor:
        """(stop - start, V) bool: the tokens seen before flat positions start..stop-1."""
        flat = (
            torch.arange(start, stop, device=self.ids.device) if self.positions is None else self.positions[start:stop]
        )
        row, t = flat // self.t_len, flat % self.t_len  # (m,), (m,)
        seen = torch.zeros(len(flat), self.vocab + 1, dtype=torch.bool, device=self.ids.device)
        seen.scatter_(1, self.context[row], True)
        later = torch.arange(self.t_len, device=self.ids.device)[None] >= t[:, None]  # (m, T): not yet drawn
        seen.scatter_(1, self.ids[row].masked_fill(later, self.vocab), True)
        return seen[:, : self.vocab]


def _scores(
    x: Tensor, start: int, temperature: float, penalty: float, history: _History | None, in_place: bool = False
) -> Tensor:
    """penalize(x) / tau for the flat positions start..start+m-1: the scores the sampler drew
    from. `x` (m, V) float32 is not modified, unless `in_place` (then it is divided in place)."""
    if history is not None:
        x = penalize(x, history.seen(start, start + len(x)), penalty)
    if temperature != 1.0:
        x = x.div_(temperature) if in_place else x / temperature
    return x


def _entropy(scores: Tensor, lse: Tensor) -> Tensor:
    """(m,) H = logsumexp(x) - sum_v softmax(x)_v x_v of scores (m, V)."""
    return lse - (torch.softmax(scores, dim=-1) * scores).sum(-1)


def _in_tile(ids: Tensor, first: int, n: int) -> tuple[Tensor, Tensor]:
    """Each id's column within the tile of vocabulary columns first..first+n-1 (clamped into
    it, so that it can index the tile) and whether the tile holds it."""
    local = ids - first
    return local.clamp(0, n - 1), (local >= 0) & (local < n)


def _chunk_grad(
    x: Tensor,
    ids: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    start: int,
    temperature: float,
    penalty: float,
    history: _History | None,
    offset: int | None = None,
) -> Tensor:
    """(m, V) float32: d(sum_i grad_out_i * logp_i) / dx for one chunk of raw scores `x` (m, V)
    float32, which this edits in place (pass a copy). `lse` (m,) is the forward's logsumexp of
    the chunk's scores. With `offset`, `x` is the scores of the vocabulary's columns offset..
    offset+n-1 only (a tile; no history): a row's sampled id adds its term where it lies inside.

    d logp / d x_v = ([v == id] - softmax(x' / tau)_v) / tau * dx'_v/dx_v, where dx'/dx is
    1/penalty on a seen token with x >= 0, penalty on a seen one with x < 0, else 1."""
    if history is not None:
        seen = history.seen(start, start + len(x))  # (m, V)
        negative = x < 0
        x = penalize(x, seen, penalty)
    if temperature != 1.0:
        x.div_(temperature)
    probs = x.sub_(lse.unsqueeze(-1)).exp_()  # softmax, in place
    g = grad_out.float().unsqueeze(-1)  # (m, 1)
    grad = probs.mul_(-g)  # -p_v * g
    if offset is None:
        grad.scatter_add_(-1, ids.unsqueeze(-1), g)  # + g at the sampled id
    else:  # + g at the sampled id where this tile holds it, + 0 elsewhere
        column, inside = _in_tile(ids, offset, x.shape[1])
        grad.scatter_add_(-1, column.unsqueeze(-1), g * inside.unsqueeze(-1))
    if temperature != 1.0:
        grad.div_(temperature)
    if history is not None:  # through the penalty: its slope on each seen token
        grad = torch.where(seen, torch.where(negative, grad * penalty, grad / penalty), grad)
    return grad


class _TokenLogprobs(torch.autograd.Function):
    """logp(id) = x'_id / tau - logsumexp(x' / tau), chunked over rows, x' = penalize(x) (x
    itself when there is no history); the gradient is `_chunk_grad`'s."""

    @staticmethod
    def forward(
        ctx,
        logits: Tensor,
        ids: Tensor,
        temperature: float,
        chunk_elements: int,
        penalty: float,
        history: _History | None,
    ) -> Tensor:
        rows, _ = logits.shape  # (M, V), M = N * T
        step = _rows_per_chunk(history.width if history else logits.shape[1], chunk_elements)
        out = torch.empty(rows, dtype=torch.float32, device=logits.device)  # (M,)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)  # (M,)
        for start in range(0, rows, step):
            scores = _scores(logits[start : start + step].float(), start, temperature, penalty, history)  # (m, V)
            lse[start : start + step] = torch.logsumexp(scores, dim=-1)
            picked = scores.gather(-1, ids[start : start + step].unsqueeze(-1)).squeeze(-1)
            out[start : start + step] = picked - lse[start : start + step]
        ctx.save_for_backward(logits, ids, lse)
        ctx.temperature = temperature
        ctx.chunk_elements = chunk_elements
        ctx.penalty, ctx.history = penalty, history
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, ids, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)  # (M, V), in the logits' dtype
        step = _rows_per_chunk(ctx.history.width if ctx.history else logits.shape[1], ctx.chunk_elements)
        for start in range(0, logits.shape[0], step):
            stop = start + step
            chunk = logits[start:stop].to(torch.float32, copy=True)  # (m, V) scratch, ours to edit
            grad_logits[start:stop] = _chunk_grad(
                chunk,
                ids[start:stop],
                lse[start:stop],
                grad_out[start:stop],
                start,
                ctx.temperature,
                ctx.penalty,
                ctx.history,
            )
        return grad_logits, None, None, None, None, None


def _history(
    context: Tensor | None, ids: Tensor, vocab: int, repetition_penalty: float, positions: Tensor | None = None
) -> _History | None:
    """The penalty's history, or None when the penalty is off (1). `positions`: which flat
    positions of `ids` the rows to score are (default: all, in order)."""
    if repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    if repetition_penalty == 1.0:
        return None
    if context is None or context.shape[0] != ids.shape[0]:
        raise ValueError(
            "a repetition penalty needs the context (N, P): the tokens before the first position, e.g. the prompt"
        )
    return _History(context, ids, vocab, positions)


def token_logprobs(
    logits: Tensor,
    ids: Tensor,
    *,
    temperature: float = 1.0,
    repetition_penalty: float = 1.0,
    context: Tensor | None = None,
    chunk_elements: int = _CHUNK_ELEMENTS,
) -> Tensor:
    """log softmax(penalize(logits) / temperature)[ids], per token.

    `logits` (N, T, V) scores for the token at each position (already shifted so that
    logits[:, t] predicts ids[:, t]); `ids` (N, T). Returns (N, T) float32, differentiable
    with respect to `logits`. Same numbers as `log_softmax(logits.float() / tau).gather`,
    at a fraction of the memory (see the module docstring).

    With `repetition_penalty` != 1, the scores at position t are first penalised (`penalize`)
    on the tokens of `context` (N, P) long (the prompt; negative entries are padding and do
    not count) and on ids[:, :t]: the distribution a sampler with that penalty drew ids[:, t]
    from (before any truncation such as top-k).
    """
    if logits.shape[:-1] != ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and ids {tuple(ids.shape)} disagree")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    lead = ids.shape
    history = _history(context, ids, logits.shape[-1], float(repetition_penalty))
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_ids = ids.reshape(-1).long()
    out = _TokenLogprobs.apply(
        flat_logits, flat_ids, float(temperature), int(chunk_elements), float(repetition_penalty), history
    )
    return out.view(lead)


def entropy(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    repetition_penalty: float = 1.0,
    ids: Tensor | None = None,
    context: Tensor | None = None,
    chunk_elements: int = _CHUNK_ELEMENTS,
) -> Tensor:
    """Entropy of softmax(penalize(logits) / temperature) at each position, in float32.

    H = logsumexp(x) - sum_v softmax(x)_v * x_v, x = penalize(logits) / tau. `logits` (N, T, V);
    returns (N, T). Computed chunk by chunk; under `torch.no_grad()` (its usual use, as a
    metric) nothing of vocabulary size outlives a chunk. With `repetition_penalty` != 1,
    the scores are penalised as in `token_logprobs`, which then needs the sampled `ids` (N, T)
    and the `context`.
    """
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    history = None
    if repetition_penalty != 1.0:
        if ids is None:
            raise ValueError("a repetition penalty needs the sampled ids (N, T)")
        history = _history(context, ids, logits.shape[-1], float(repetition_penalty))
    step = _rows_per_chunk(history.width if history else flat.shape[1], chunk_elements)
    parts = []
    for start in range(0, flat.shape[0], step):
        x = _scores(flat[start : start + step].float(), start, temperature, repetition_penalty, history)  # (m, V)
        parts.append(_entropy(x, torch.logsumexp(x, dim=-1)))
    if not parts:
        return torch.zeros(lead, dtype=torch.float32, device=logits.device)
    return torch.cat(parts).view(lead)


def _head_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor | None = None) -> Tensor:
    """(m, V) float32 logits of one chunk of hidden states (m, H), computed in the head's
    compute dtype (the operands' dtype; a fresh tensor, ours to edit), or into the float32
    `out` (low-precision operands' logits cast into it)."""
    if out is None:
        return F.linear(hidden, weight, bias).float()
    if hidden.dtype != torch.float32:
        return out.copy_(F.linear(hidden, weight, bias))
    if bias is None:
        return torch.mm(hidden, weight.T, out=out)
    return torch.addmm(bias, hidden, weight.T, out=out)


class _Scratch:
    """The float32 buffers of a chunked head's calls, allocated once per call and reused by every
    chunk and tile: no fresh vocabulary-sized tensor a chunk (each one's pages faulted in, or
    the allocator's free memory fragmented by them). Without a repetition penalty, in float32
    or tiled (`_tiling`: bf16 logits cast into the buffer), `in_place`: the logits of a chunk's
    rows over a tile of the vocabulary are computed into the buffer and reduced in place
    (`_Online`), the entropy's product in a second buffer (`spare`); otherwise (bf16 logits
    with a backward to come, the penalty's history) each chunk's come fresh, over the whole
    vocabulary, as `_head_logits` makes them."""

    def __init__(self, rows, step, tile, like: Tensor, dtype, history, spare: bool = False, tiled: bool = False):
        self.in_place = history is None and rows > 0 and (dtype == torch.float32 or tiled)
        size = min(rows, step) * tile
        self.buffer = like.new_empty(size, dtype=torch.float32) if self.in_place else None
        self.spare = like.new_empty(size, dtype=torch.float32) if self.in_place and spare else None

    def logits(self, hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """(m, n) _head_logits(hidden, weight, bias) of hidden (m, H) over weight's n rows, ours
        to edit: in the buffer where in place."""
        out = self.buffer[: len(hidden) * len(weight)].view(len(hidden), len(weight)) if self.in_place else None
        return _head_logits(hidden, weight, bias, out)

    def spare_for(self, x: Tensor) -> Tensor:
        """The spare buffer (in place, with the entropy) shaped as `x`."""
        return self.spare[: x.numel()].view(x.shape)


LOW_PRECISION = (torch.bfloat16, torch.float16)  # logits cast up to float32 for their reduction


def _tiling(
    vocab: int, tile: int, dtype: torch.dtype, hidden: Tensor, history: _History | None, backward: bool = True
) -> int:
    """The columns of the vocabulary a chunk's logits are computed over at a time: `tile` in
    float32 without a penalty's history (the in-place path), and for bf16 or fp16 logits on a
    CPU where no backward follows (a reference's or an old policy's pass: each tile's logits
    cast into the float32 buffer and reduced there, where the whole vocabulary's would be cast
    up and reduced in passes over memory); else the whole vocabulary."""
    if history is None and (
        (dtype == torch.float32 and hidden.dtype == torch.float32)
        or (dtype in LOW_PRECISION and hidden.device.type == "cpu" and not backward)
    ):
        return max(1, min(vocab, tile))
    return vocab


class _Online:
    """The log-sum-exp (and the entropy) of a chunk's rows, reduced tile by tile over the
    vocabulary, as the online softmax does: a running maximum, the sum of exp(x - max) and of
    exp(x - max) * x, rescaled by exp(old max - new max) when the maximum rises. Over a single
    tile, the very operations of torch.logsumexp (max, exp of the difference, sum, log, plus
    the max) and of `_entropy`'s sum of softmax(x) * x: the same numbers as before tiling."""

    def __init__(self):
        self.maxes = self.total = self.weighted = None

    def add(self, x: Tensor, spare: Tensor | None) -> None:
        """Reduce the scores `x` (m, n), which this overwrites. With `spare` (m, n) (the entropy
        asked for), the exponentials go there and `x` is kept until their product is taken."""
        maxes = x.amax(-1)
        if self.maxes is None:
            maxes.masked_fill_(maxes.abs() == math.inf, 0)
            rescale = None
        else:
            maxes = torch.maximum(self.maxes, maxes)
            rescale = (self.maxes - maxes).exp_()
        if spare is None:
            total, weighted = x.sub_(maxes.unsqueeze(-1)).exp_().sum(-1), None
        else:
            exps = torch.sub(x, maxes.unsqueeze(-1), out=spare).exp_()
            total = exps.sum(-1)
            weighted = exps.mul_(x).sum(-1)
        if rescale is not None:
            total = self.total.mul_(rescale).add_(total)
            if weighted is not None:
                weighted = self.weighted.mul_(rescale).add_(weighted)
        self.maxes, self.total, self.weighted = maxes, total, weighted

    def result(self) -> tuple[Tensor, Tensor | None]:
        """(m,) the logsumexp and, where `spare` was given, the entropy logsumexp - sum softmax(x) x."""
        lse = self.total.log().add_(self.maxes)
        if self.weighted is None:
            return lse, None
        return lse, lse - self.weighted.div_(self.total)


class _HeadLogprobs(torch.autograd.Function):
    """token_logprobs(linear(hidden, weight, bias), ids) and, optionally, entropy(...), with
    each chunk's logits computed from the hidden states and dropped; the backward recomputes
    them. The entropy is a metric: it is returned without a gradient."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        ids: Tensor,
        temperature: float,
        chunk_elements: int,
        penalty: float,
        history: _History | None,
        with_entropy: bool,
        dtype: torch.dtype,
        vocab_tile: int,
    ) -> tuple[Tensor, Tensor]:
        rows, vocab = hidden.shape[0], weight.shape[0]  # hidden (M, H), weight (V, H)
        tile = _tiling(vocab, vocab_tile, dtype, hidden, history, backward=any(ctx.needs_input_grad[:3]))
        step = _rows_per_chunk(history.width if history else tile, chunk_elements)
        out = torch.empty(rows, dtype=torch.float32, device=hidden.device)  # (M,)
        lse = torch.empty(rows, dtype=torch.float32, device=hidden.device)  # (M,)
        ent = torch.empty(rows if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):  # the casts are explicit: autocast's, once
            w = weight.to(dtype)  # (V, H): the same tensor unless autocast's dtype differs from the head's
            b = None if bias is None else bias.to(dtype)
            scratch = _Scratch(rows, step, tile, hidden, dtype, history, spare=with_entropy, tiled=tile < vocab)
            for start in range(0, rows, step):
                stop = start + step
                h, chunk_ids, online = hidden[start:stop].to(dtype), ids[start:stop], _Online()
                for first in range(0, vocab, tile):
                    columns = slice(first, first + tile)
                    x = scratch.logits(h, w[columns], None if b is None else b[columns])  # (m, n)
                    scores = _scores(x, start, temperature, penalty, history, in_place=scratch.in_place)
                    if tile == vocab:  # before the reduction overwrites them
                        picked = scores.gather(-1, chunk_ids.unsqueeze(-1)).squeeze(-1)
                    else:
                        column, inside = _in_tile(chunk_ids, first, scores.shape[1])
                        here = scores.gather(-1, column.unsqueeze(-1)).squeeze(-1)
                        picked = here if first == 0 else torch.where(inside, here, picked)
                    if scratch.in_place:
                        online.add(scores, scratch.spare_for(scores) if with_entropy else None)
                    else:  # fresh scores over the whole vocabulary (`_tiling`)
                        whole = torch.logsumexp(scores, dim=-1)
                        reduced = whole, _entropy(scores, whole) if with_entropy else None
                lse[start:stop], chunk_entropy = online.result() if scratch.in_place else reduced
                out[start:stop] = picked - lse[start:stop]
                if with_entropy:
                    ent[start:stop] = chunk_entropy
            del scratch
        ctx.save_for_backward(hidden, w, b, ids, lse)
        ctx.weight_dtype, ctx.bias_dtype = weight.dtype, None if bias is None else bias.dtype
        # A weight tied to the input embedding may carry where its gradient meets the embedding's
        # (grpo.train.models.TiedGradient): handed over there in the backward, not returned.
        ctx.tied = getattr(weight, "_grpo_tied_gradient", None)
        if ctx.tied is not None:
            ctx.tied.reset()
        ctx.temperature, ctx.chunk_elements, ctx.penalty, ctx.history, ctx.dtype, ctx.tile = (
            temperature,
            chunk_elements,
            penalty,
            history,
            dtype,
            tile,
        )
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor, _grad_entropy: Tensor | None):
        hidden, w, b, ids, lse = ctx.saved_tensors
        dtype = ctx.dtype
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None  # (M, H)
        # The head's gradient sums over every chunk: accumulated in float32, returned in its dtype.
        grad_weight = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_weight else None  # (V, H)
        grad_bias = torch.zeros(w.shape[0], dtype=torch.float32, device=w.device) if need_bias else None  # (V,)
        vocab, tile = w.shape[0], ctx.tile
        step = _rows_per_chunk(ctx.history.width if ctx.history else tile, ctx.chunk_elements)
        scratch = _Scratch(hidden.shape[0], step, tile, hidden, dtype, ctx.history)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], step):
                stop = start + step
                h = hidden[start:stop].to(dtype)  # (m, H)
                for first in range(0, vocab, tile):
                    columns = slice(first, first + tile)
                    wt = w[columns]  # (n, H)
                    grad = _chunk_grad(
                        scratch.logits(h, wt, None if b is None else b[columns]),
                        ids[start:stop],
                        lse[start:stop],
                        grad_out[start:stop],
                        start,
                        ctx.temperature,
                        ctx.penalty,
                        ctx.history,
                        offset=None if tile == vocab else first,
                    )  # (m, n) float32
                    g = grad.to(dtype)  # what the logits' gradient is in the plain path (their dtype)
                    if need_hidden and first > 0:  # a later tile's share (float32 only: `_tiling`)
                        grad_hidden[start:stop].addmm_(g, wt)
                    elif need_hidden and grad_hidden.dtype == g.dtype:
                        torch.mm(g, wt, out=grad_hidden[start:stop])  # (m, H), written in place
                    elif need_hidden:
                        grad_hidden[start:stop] = g @ wt
                    if need_weight:
                        if dtype == torch.float32:
                            grad_weight[columns].addmm_(g.T, h)
                        else:
                            grad_weight[columns] += (g.T @ h).float()
                    if need_bias:
                        grad_bias[columns] += grad.sum(0)
        del scratch
        if grad_weight is not None:
            grad_weight = grad_weight.to(ctx.weight_dtype)
            if ctx.tied is not None:
                ctx.tied.give(grad_weight)
                grad_weight = None
        return (
            grad_hidden,
            grad_weight,
            None if grad_bias is None else grad_bias.to(ctx.bias_dtype),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    ids: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    repetition_penalty: float = 1.0,
    context: Tensor | None = None,
    chunk_elements: int = _CHUNK_ELEMENTS,
    with_entropy: bool = False,
    mask: Tensor | None = None,
    vocab_tile: int = VOCAB_TILE,
) -> tuple[Tensor, Tensor | None]:
    """`token_logprobs` (and `entropy`) of the logits `linear(hidden, weight, bias)`, without
    ever holding them: (N, T) float32 log-probabilities, and the (N, T) entropy when
    `with_entropy` (else None).

    `hidden` (N, T, H): the LM head's input at the positions that predict `ids` (N, T);
    `weight` (V, H) and `bias` (V,): the head's. Each chunk of rows gets its logits computed,
    reduced and dropped (chunk_elements / V rows at a time, as token_logprobs), and the
    backward recomputes them: the largest vocabulary-sized tensor is one chunk's. The
    log-probs are differentiable with respect to `hidden`, `weight` and `bias` (a weight tied
    to the input embeddings gets its gradient like any other use of the parameter); the
    entropy, a metric, is not. Under torch.autocast the logits are computed in its dtype, as
    the head's own forward would; temperature, `repetition_penalty` and `context` as in
    `token_logprobs`.

    `vocab_tile`: the columns of the vocabulary a chunk's float32 logits are computed over
    at a time (the log-sum-exp carried across tiles; the same numbers to float rounding, and
    bit for bit those of the untiled computation when the vocabulary fits in one tile).

    With `mask` (N, T) bool, only the positions it marks are computed (their hidden states
    gathered first; the others, e.g. the padding after each completion, get 0 log-prob, 0
    entropy and no gradient): a batch of completions of varying length pays for its tokens,
    not for its longest row times its rows. The marked positions' numbers are unchanged.
    """
    if hidden.shape[:-1] != ids.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and ids {tuple(ids.shape)} disagree")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"head weight {tuple(weight.shape)} does not take hidden states of size {hidden.shape[-1]}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    device = hidden.device.type
    # Under autocast its dtype; else the operands' (a bf16-stored weight with float32 hidden
    # states, as the reference computes on a CPU without bf16 instructions: float32).
    dtype = (
        torch.get_autocast_dtype(device)
        if torch.is_autocast_enabled(device)
        else torch.promote_types(weight.dtype, hidden.dtype)
    )
    flat_hidden, flat_ids, index = hidden.reshape(-1, hidden.shape[-1]), ids.reshape(-1).long(), None
    if mask is not None:
        if mask.shape != ids.shape:
            raise ValueError(f"mask {tuple(mask.shape)} and ids {tuple(ids.shape)} disagree")
        index = mask.reshape(-1).nonzero().squeeze(1)  # (M,) the positions computed
        flat_hidden, flat_ids = flat_hidden[index], flat_ids[index]
    history = _history(context, ids, weight.shape[0], float(repetition_penalty), index)
    out, ent = _HeadLogprobs.apply(
        flat_hidden,
        weight,
        bias,
        flat_ids,
        float(temperature),
        int(chunk_elements),
        float(repetition_penalty),
        history,
        bool(with_entropy),
        dtype,
        int(vocab_tile),
    )
    if index is not None:  # back to every position, 0 where nothing was computed
        out = out.new_zeros(ids.numel()).index_copy(0, index, out)
        if with_entropy:
            ent = ent.new_zeros(ids.numel()).index_copy(0, index, ent)
    return out.view(ids.shape), ent.view(ids.shape) if with_entropy else None
