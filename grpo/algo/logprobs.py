"""Log-probabilities and entropy of sampled tokens, without a full-vocabulary float32 copy.

`log_softmax(logits.float(), -1).gather(-1, ids)` materialises an (N, T, V) float32 tensor
(and autograd keeps it for the backward pass): for 32 completions x 1024 tokens x 150k
vocabulary that is 20 GB. Here the work is done over chunks of rows: each chunk is upcast,
reduced to one log-sum-exp per token, and dropped. The backward pass recomputes each chunk's
softmax from the logits instead of storing it. Peak extra memory is one chunk plus the
(N, T) results, and the gradient with respect to the logits (in the logits' dtype).

Results are computed in float32 whatever the logits' dtype (bf16 logits give float32
log-probabilities), which is what the ratio and KL need.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["token_logprobs", "entropy"]

# Elements of float32 scratch per chunk: 2**24 = 64 MiB.
_CHUNK_ELEMENTS = 1 << 24


def _rows_per_chunk(vocab: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // max(vocab, 1))


class _TokenLogprobs(torch.autograd.Function):
    """logp(id) = x_id / tau - logsumexp(x / tau), chunked over rows.

    d logp / d x_v = ([v == id] - softmax(x / tau)_v) / tau.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, ids: Tensor, temperature: float, chunk_elements: int) -> Tensor:
        rows, _ = logits.shape  # (M, V), M = N * T
        step = _rows_per_chunk(logits.shape[1], chunk_elements)
        out = torch.empty(rows, dtype=torch.float32, device=logits.device)  # (M,)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)  # (M,)
        for start in range(0, rows, step):
            chunk = logits[start : start + step].float()  # (m, V); a view when already fp32
            if temperature != 1.0:
                chunk = chunk / temperature
            lse[start : start + step] = torch.logsumexp(chunk, dim=-1)
            picked = chunk.gather(-1, ids[start : start + step].unsqueeze(-1)).squeeze(-1)
            out[start : start + step] = picked - lse[start : start + step]
        ctx.save_for_backward(logits, ids, lse)
        ctx.temperature = temperature
        ctx.chunk_elements = chunk_elements
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, ids, lse = ctx.saved_tensors
        temperature = ctx.temperature
        grad_logits = torch.empty_like(logits)  # (M, V), in the logits' dtype
        step = _rows_per_chunk(logits.shape[1], ctx.chunk_elements)
        for start in range(0, logits.shape[0], step):
            stop = start + step
            chunk = logits[start:stop].to(torch.float32, copy=True)  # (m, V) scratch, ours to edit
            if temperature != 1.0:
                chunk.div_(temperature)
            probs = chunk.sub_(lse[start:stop].unsqueeze(-1)).exp_()  # softmax, in place
            g = grad_out[start:stop].float().unsqueeze(-1)  # (m, 1)
            grad = probs.mul_(-g)  # -p_v * g
            grad.scatter_add_(-1, ids[start:stop].unsqueeze(-1), g)  # + g at the sampled id
            if temperature != 1.0:
                grad.div_(temperature)
            grad_logits[start:stop] = grad
        return grad_logits, None, None, None


def token_logprobs(
    logits: Tensor, ids: Tensor, *, temperature: float = 1.0, chunk_elements: int = _CHUNK_ELEMENTS
) -> Tensor:
    """log softmax(logits / temperature)[ids], per token.

    `logits` (N, T, V) scores for the token at each position (already shifted so that
    logits[:, t] predicts ids[:, t]); `ids` (N, T). Returns (N, T) float32, differentiable
    with respect to `logits`. Same numbers as `log_softmax(logits.float() / tau).gather`,
    at a fraction of the memory (see the module docstring).
    """
    if logits.shape[:-1] != ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and ids {tuple(ids.shape)} disagree")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    lead = ids.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_ids = ids.reshape(-1).long()
    out = _TokenLogprobs.apply(flat_logits, flat_ids, float(temperature), int(chunk_elements))
    return out.view(lead)


def entropy(
    logits: Tensor, *, temperature: float = 1.0, chunk_elements: int = _CHUNK_ELEMENTS
) -> Tensor:
    """Entropy of softmax(logits / temperature) at each position, in float32.

    H = logsumexp(x) - sum_v softmax(x)_v * x_v, x = logits / tau. `logits` (N, T, V);
    returns (N, T). Computed chunk by chunk; under `torch.no_grad()` (its usual use, as a
    metric) nothing of vocabulary size outlives a chunk.
    """
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    step = _rows_per_chunk(flat.shape[1], chunk_elements)
    parts = []
    for start in range(0, flat.shape[0], step):
        x = flat[start : start + step].float() / temperature  # (m, V)
        lse = torch.logsumexp(x, dim=-1)  # (m,)
        probs = torch.softmax(x, dim=-1)
        parts.append(lse - (probs * x).sum(-1))
    if not parts:
        return torch.zeros(lead, dtype=torch.float32, device=logits.device)
    return torch.cat(parts).view(lead)
