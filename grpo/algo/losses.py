"""The clipped policy loss (shared by PPO and GRPO), its aggregation, and the value loss.

Aggregation is where GRPO's variants differ most, so each is a named function:
- "seq-mean-token-mean"      DeepSeekMath eq. 3: 1/G sum_i 1/|o_i| sum_t l_it (each output weighs the same)
- "token-mean"               DAPO (arXiv 2503.14476): sum_it l_it / sum_i |o_i| (each token weighs the same)
- "seq-mean-token-sum-norm"  Dr. GRPO (arXiv 2503.20783): sum_it l_it / (N * max_tokens), no length bias
Gradient accumulation: give `aggregate` the whole batch's `num_sequences` and `num_tokens`
(and a fixed `max_tokens`) for each micro-batch, and the micro-batch losses sum to the whole
batch's loss in every mode. `bradley_terry_loss` trains reward models from comparisons.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "policy_ratio",
    "policy_loss",
    "clipped_fraction",
    "pairwise_wins",
    "aggregate",
    "value_loss",
    "AGGREGATIONS",
    "bradley_terry_loss",
]


def _token_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """PPO's ratio per token: log(pi_theta(o_t) / pi_old(o_t))."""
    return logprobs - old_logprobs


def _sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """GSPO (arXiv 2507.18071): one length-normalised ratio per sequence,
    s_i = exp(1/|o_i| sum_t log(pi_theta / pi_old)), shared by all its tokens."""
    m = mask.to(logprobs.dtype)
    mean = ((logprobs - old_logprobs) * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
    return mean.expand_as(logprobs)  # (N, T)


RATIO_LEVELS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "token": _token_log_ratio,
    "sequence": _sequence_log_ratio,
}


def policy_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, *, level: str = "token") -> Tensor:
    """Importance ratio pi_theta / pi_old per token, (N, T); `level="sequence"` is GSPO's."""
    try:
        log_ratio = RATIO_LEVELS[level](logprobs, old_logprobs, mask)
    except KeyError:
        raise ValueError(f"level must be one of {sorted(RATIO_LEVELS)}, got {level!r}") from None
    return torch.exp(log_ratio)


def _per_token_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    return advantages.unsqueeze(1).expand_as(like) if advantages.ndim == 1 else advantages


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    level: str = "token",
    dual_clip: float | None = None,
) -> Tensor:
    """PPO's clipped surrogate, per token (PPO arXiv 1707.06347 eq. 7; DeepSeekMath eq. 3).

    l_t = -min(rho_t * A_t, clip(rho_t, 1 - clip_low, 1 + clip_high) * A_t)
    with rho_t = exp(logprobs - old_logprobs). Asymmetric bounds are DAPO's clip-higher.
    `level="sequence"` replaces rho_t by GSPO's sequence ratio (same value for every token).
    `dual_clip=c` (> 1; Ye et al. 2020, arXiv 1912.09729) caps the loss of negative-advantage
    tokens at -c * A_t, so a huge ratio cannot blow it up.
    `advantages` is (N,) (one per sequence) or (N, T). Returns (N, T), zero where the mask
    is zero; reduce it with `aggregate`.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    advantages = _per_token_advantages(advantages, logprobs)  # (N, T)
    ratio = policy_ratio(logprobs, old_logprobs, mask, level=level)  # (N, T)
    unclipped = -ratio * advantages
    clipped = -torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)  # (N, T)
    if dual_clip is not None:
        capped = torch.minimum(loss, -dual_clip * advantages)
        loss = torch.where(advantages < 0, capped, loss)
    return loss * mask.to(loss.dtype)


@torch.no_grad()
def clipped_fraction(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    level: str = "token",
) -> Tensor:
    """Fraction of valid tokens whose gradient the clip removed (ratio outside the bound on
    the side the advantage pushes toward). A diagnostic: with one update epoch it is 0."""
    advantages = _per_token_advantages(advantages, logprobs)
    ratio = policy_ratio(logprobs, old_logprobs, mask, level=level)
    clipped = ((ratio > 1 + clip_high) & (advantages > 0)) | ((ratio < 1 - clip_low) & (advantages < 0))
    m = mask.to(torch.bool)
    return (clipped & m).sum() / m.sum().clamp(min=1)


def _seq_mean_token_mean(x, m, num_sequences, num_tokens, max_tokens):
    per_sequence = (x * m).sum(1) / m.sum(1).clamp(min=1)  # (N,)
    return per_sequence.sum() / num_sequences


def _token_mean(x, m, num_sequences, num_tokens, max_tokens):
    return (x * m).sum() / max(num_tokens, 1)


def _seq_mean_token_sum_norm(x, m, num_sequences, num_tokens, max_tokens):
    return (x * m).sum() / (num_sequences * max_tokens)


AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "seq-mean-token-mean": _seq_mean_token_mean,
    "token-mean": _token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: str,
    *,
    max_tokens: int | None = None,
    num_sequences: int | None = None,
    num_tokens: int | float | None = None,
) -> Tensor:
    """Reduce a per-token loss (N, T) to a scalar.

    "seq-mean-token-mean":     1/N sum_i (1/|o_i| sum_t x_it)       (DeepSeekMath)
    "token-mean":              sum_it x_it / sum_i |o_i|            (DAPO)
    "seq-mean-token-sum-norm": sum_it x_it / (N * max_tokens)       (Dr. GRPO)
    |o_i| is the number of valid tokens of row i (rows with none contribute 0).
    `max_tokens` defaults to T. For gradient accumulation give every micro-batch the whole
    batch's `num_sequences` (N) and `num_tokens` (sum of the mask) and the same
    `max_tokens`; the micro-batch results then sum to the whole-batch result.
    """
    try:
        reduce = AGGREGATIONS[mode]
    except KeyError:
        raise ValueError(f"mode must be one of {sorted(AGGREGATIONS)}, got {mode!r}") from None
    m = mask.to(per_token.dtype)
    num_sequences = per_token.shape[0] if num_sequences is None else num_sequences
    num_tokens = float(m.sum()) if num_tokens is None else num_tokens
    max_tokens = per_token.shape[1] if max_tokens is None else max_tokens
    return reduce(per_token, m, num_sequences, num_tokens, max_tokens)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None = None,
    num_tokens: int | float | None = None,
) -> Tensor:
    """PPO's clipped value loss (as in OpenAI's baselines and InstructGPT-style RLHF).

    0.5 * masked_mean(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)); without `clip`
    it is 0.5 * masked_mean((V - R)^2). All arguments (N, T). `num_tokens` is the whole
    batch's token count when accumulating micro-batches (defaults to this mask's sum).
    """
    m = mask.to(values.dtype)
    loss = (values - returns) ** 2
    if clip is not None:
        clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
        loss = torch.maximum(loss, (clipped_values - returns) ** 2)
    num_tokens = float(m.sum()) if num_tokens is None else num_tokens
    return 0.5 * (loss * m).sum() / max(num_tokens, 1)


def bradley_terry_loss(chosen_rewards: Tensor, rejected_rewards: Tensor) -> Tensor:
    """The pairwise loss of a reward model: -log P(chosen preferred over rejected), averaged.

    loss = mean_i -log sigmoid(r_chosen_i - r_rejected_i)
    Bradley & Terry (1952) model P(a > b) = sigmoid(r_a - r_b); InstructGPT (arXiv 2203.02155)
    eq. 1 trains its reward model with this loss. Both arguments (N,), one pair per row.
    logsigmoid, not log(sigmoid(.)): in float32 sigmoid(m) is 0 for margins below about -88
    (exp(88) overflows), so its log would be -inf; logsigmoid stays finite, as does its gradient.
    """
    margin = chosen_rewards - rejected_rewards  # (N,)
    return -F.logsigmoid(margin).mean()


def pairwise_wins(chosen_rewards: Tensor, rejected_rewards: Tensor) -> Tensor:
    """(N,) float64: 1 where r(chosen) > r(rejected), 1/2 on a tie, else 0; its mean is a
    reward model's pairwise accuracy."""
    return (chosen_rewards > rejected_rewards).double() + 0.5 * (chosen_rewards == rejected_rewards).double()
