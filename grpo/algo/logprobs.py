"""Log-probabilities and entropy of sampled tokens, without a full-vocabulary float32 copy.

`log_softmax(logits.float(), -1).gather(-1, ids)` materialises an (N, T, V) float32 tensor
(and autograd keeps it for the backward pass): for 32 completions x 1024 tokens x 150k
vocabulary that is 20 GB. Here the work is done over chunks of rows: each chunk is upcast,
reduced to one log-sum-exp per token, and dropped. The backward pass recomputes each chunk's
softmax from the logits instead of storing it. Peak extra memory is one chunk plus the
(N, T) results, and the gradient with respect to the logits (in the logits' dtype).

Results are computed in float32 whatever the logits' dtype (bf16 logits give float32
log-probabilities), which is what the ratio and KL need.

With a repetition penalty (`penalize`, rollout.repetition_penalty) the scores at position t
are first penalised on the tokens before t (the context, i.e. the prompt, and the sampled
tokens 0..t-1), exactly as the sampler penalised them when it drew token t; the mask of those
tokens is built per chunk too (one (rows, V) bool at a time), and a penalty of 1 costs nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["token_logprobs", "entropy", "penalize"]

# Elements of float32 scratch per chunk: 2**24 = 64 MiB.
_CHUNK_ELEMENTS = 1 << 24


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

    def __init__(self, context: Tensor, ids: Tensor, vocab: int):
        self.vocab = vocab
        self.t_len = ids.shape[1]
        self.context = context.long().masked_fill(context < 0, vocab)  # (N, P); padding -> the spare column
        self.ids = ids.long()  # (N, T)
        self.width = max(vocab + 1, context.shape[1] + self.t_len)  # elements per row of a chunk's scratch

    def seen(self, start: int, stop: int) -> Tensor:
        """(stop - start, V) bool: the tokens seen before flat positions start..stop-1."""
        flat = torch.arange(start, stop, device=self.ids.device)
        row, t = flat // self.t_len, flat % self.t_len  # (m,), (m,)
        seen = torch.zeros(len(flat), self.vocab + 1, dtype=torch.bool, device=self.ids.device)
        seen.scatter_(1, self.context[row], True)
        later = torch.arange(self.t_len, device=self.ids.device)[None] >= t[:, None]  # (m, T): not yet drawn
        seen.scatter_(1, self.ids[row].masked_fill(later, self.vocab), True)
        return seen[:, : self.vocab]


class _TokenLogprobs(torch.autograd.Function):
    """logp(id) = x'_id / tau - logsumexp(x' / tau), chunked over rows, x' = penalize(x) (x
    itself when there is no history).

    d logp / d x_v = ([v == id] - softmax(x' / tau)_v) / tau * dx'_v/dx_v, where dx'/dx is
    1/penalty on a seen token with x >= 0, penalty on a seen one with x < 0, else 1.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, ids: Tensor, temperature: float, chunk_elements: int,
                penalty: float, history: _History | None) -> Tensor:
        rows, _ = logits.shape  # (M, V), M = N * T
        step = _rows_per_chunk(history.width if history else logits.shape[1], chunk_elements)
        out = torch.empty(rows, dtype=torch.float32, device=logits.device)  # (M,)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)  # (M,)
        for start in range(0, rows, step):
            chunk = logits[start : start + step].float()  # (m, V); a view when already fp32
            if history is not None:
                chunk = penalize(chunk, history.seen(start, start + len(chunk)), penalty)
            if temperature != 1.0:
                chunk = chunk / temperature
            lse[start : start + step] = torch.logsumexp(chunk, dim=-1)
            picked = chunk.gather(-1, ids[start : start + step].unsqueeze(-1)).squeeze(-1)
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
        temperature, penalty, history = ctx.temperature, ctx.penalty, ctx.history
        grad_logits = torch.empty_like(logits)  # (M, V), in the logits' dtype
        step = _rows_per_chunk(history.width if history else logits.shape[1], ctx.chunk_elements)
        for start in range(0, logits.shape[0], step):
            stop = start + step
            chunk = logits[start:stop].to(torch.float32, copy=True)  # (m, V) scratch, ours to edit
            if history is not None:
                seen = history.seen(start, start + len(chunk))  # (m, V)
                negative = chunk < 0
                chunk = penalize(chunk, seen, penalty)
            if temperature != 1.0:
                chunk.div_(temperature)
            probs = chunk.sub_(lse[start:stop].unsqueeze(-1)).exp_()  # softmax, in place
            g = grad_out[start:stop].float().unsqueeze(-1)  # (m, 1)
            grad = probs.mul_(-g)  # -p_v * g
            grad.scatter_add_(-1, ids[start:stop].unsqueeze(-1), g)  # + g at the sampled id
            if temperature != 1.0:
                grad.div_(temperature)
            if history is not None:  # through the penalty: its slope on each seen token
                grad = torch.where(seen, torch.where(negative, grad * penalty, grad / penalty), grad)
            grad_logits[start:stop] = grad
        return grad_logits, None, None, None, None, None


def _history(context: Tensor | None, ids: Tensor, vocab: int, repetition_penalty: float) -> _History | None:
    """The penalty's history, or None when the penalty is off (1)."""
    if repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    if repetition_penalty == 1.0:
        return None
    if context is None or context.shape[0] != ids.shape[0]:
        raise ValueError("a repetition penalty needs the context (N, P): the tokens before the first position, e.g. the prompt")
    return _History(context, ids, vocab)


def token_logprobs(
    logits: Tensor, ids: Tensor, *, temperature: float = 1.0, repetition_penalty: float = 1.0,
    context: Tensor | None = None, chunk_elements: int = _CHUNK_ELEMENTS
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
    out = _TokenLogprobs.apply(flat_logits, flat_ids, float(temperature), int(chunk_elements), float(repetition_penalty), history)
    return out.view(lead)


def entropy(
    logits: Tensor, *, temperature: float = 1.0, repetition_penalty: float = 1.0, ids: Tensor | None = None,
    context: Tensor | None = None, chunk_elements: int = _CHUNK_ELEMENTS
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
        x = flat[start : start + step].float()  # (m, V)
        if history is not None:
            x = penalize(x, history.seen(start, start + len(x)), repetition_penalty)
        x = x / temperature
        lse = torch.logsumexp(x, dim=-1)  # (m,)
        probs = torch.softmax(x, dim=-1)
        parts.append(lse - (probs * x).sum(-1))
    if not parts:
        return torch.zeros(lead, dtype=torch.float32, device=logits.device)
    return torch.cat(parts).view(lead)
