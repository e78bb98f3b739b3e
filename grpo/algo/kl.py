"""KL between the policy and the reference, per token, and PPO's KL-penalised reward.

The estimators are Schulman's ("Approximating KL divergence", 2020) for KL(pi_theta || pi_ref)
from tokens sampled from pi_theta, with log r = ref_logprobs - logprobs:
- k1 = -log r                     unbiased, can be negative (PPO's per-token penalty);
- k2 = (log r)^2 / 2              biased, low variance, >= 0;
- k3 = (r - 1) - log r            unbiased, >= 0 (DeepSeekMath eq. 4: GRPO's loss term).

Where the KL goes is the difference: PPO subtracts beta * KL from every token's reward
(`kl_penalized_rewards`); GRPO adds beta * k3 to the loss, leaving the reward alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["kl_estimate", "kl_penalized_rewards", "KL_ESTIMATORS"]


def _k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return logprobs - ref_logprobs


def _k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return 0.5 * (logprobs - ref_logprobs) ** 2


def _k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    log_ratio = ref_logprobs - logprobs  # log(pi_ref / pi_theta)
    return torch.exp(log_ratio) - log_ratio - 1


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta.

    k1 = logp - ref;  k2 = 0.5 * (logp - ref)^2;  k3 = exp(ref - logp) - (ref - logp) - 1.
    `logprobs` and `ref_logprobs` are (N, T) log-probabilities of the sampled tokens under
    the policy and the reference. Returns (N, T).
    """
    try:
        estimator = KL_ESTIMATORS[kind]
    except KeyError:
        raise ValueError(f"kind must be one of {sorted(KL_ESTIMATORS)}, got {kind!r}") from None
    return estimator(logprobs, ref_logprobs)


def kl_penalized_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    *,
    beta: float,
    kind: str = "k1",
) -> Tensor:
    """PPO's per-token reward (InstructGPT; DeepSeekMath eq. 2).

    r_t = -beta * KL_t at every valid token, plus the sequence score at the last valid token:
    r_t = score * [t == last] - beta * kl_estimate(logp_t, ref_t, kind).
    `scores` (N,), the rest (N, T). Returns (N, T), zero where the mask is zero. A row with
    no valid token gets no score.
    """
    m = mask.to(logprobs.dtype)
    rewards = -beta * kl_estimate(logprobs, ref_logprobs, kind) * m  # (N, T)
    t_len = m.shape[1]
    last = t_len - 1 - m.flip(1).argmax(1)  # (N,) index of the last valid token
    has_tokens = m.sum(1) > 0  # (N,)
    bonus = torch.where(has_tokens, scores.to(rewards.dtype), torch.zeros_like(scores, dtype=rewards.dtype))
    return rewards.scatter_add(1, last.unsqueeze(1), bonus.unsqueeze(1))
