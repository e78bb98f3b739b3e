"""The train-inference mismatch: how far the sampler's distribution is from the trainer's, and
the correction of the policy gradient for it.

An inference engine (other kernels, bf16, stale weights) samples from pi_sampler, not from
pi_old, the policy the ratio is anchored to. With log r_t = old_logprobs - sampled_logprobs:
`mismatch_kl` is KL(pi_sampler || pi_old) per token (k3); `token_tis` weighs token t's
policy-gradient term by min(r_t, C), detached (truncated IS, Yao et al. 2025); `sequence_mask`
drops a sequence whose R = prod_t r_t lies outside [1/C, C] (Liu, Li et al. 2025; verl's
rollout_rs seq_sum_k1). Deliberate deviation from TRL's `sequence_mask`: a kept sequence
weighs 1, not R, since R's variance grows with the length (verl's pure rejection).
docs/sampling.md explains the choice.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from grpo.algo.kl import kl_estimate

__all__ = [
    "ENGINE_CORRECTIONS",
    "engine_correction",
    "mismatch_kl",
    "mismatch_log_ratio",
]


def mismatch_log_ratio(old_logprobs: Tensor, sampled_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log(pi_old / pi_sampler) per token, (N, T); 0 where the mask is 0."""
    return (old_logprobs - sampled_logprobs) * mask.to(old_logprobs.dtype)


def mismatch_kl(old_logprobs: Tensor, sampled_logprobs: Tensor, mask: Tensor) -> Tensor:
    """KL(pi_sampler || pi_old) per token from the sampler's tokens: k3 = r - 1 - log r with
    r = pi_old / pi_sampler. (N, T), 0 where the mask is 0."""
    return kl_estimate(sampled_logprobs, old_logprobs, "k3") * mask.to(old_logprobs.dtype)


# Each correction: (log r (N, T), mask (N, T), C) -> (weights (N, T), changed (N, T) bool).
# `weights` multiply the per-token loss (token_tis: its policy-gradient term); `changed` marks the
# loss-mask tokens whose weight the cap or the mask set (a diagnostic).


def _no_correction(log_ratio: Tensor, mask: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    return torch.ones_like(log_ratio), torch.zeros_like(mask, dtype=torch.bool)


def _token_tis(log_ratio: Tensor, mask: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    # Uncapped, each token's term has the on-policy expectation given its prefix,
    # E_sampler[r_t g_t | o_<t] = E_old[g_t | o_<t]; the prefixes stay the sampler's (the bias
    # that remains, small while the policies are close). The cap bounds the variance at the
    # price of a bias where r_t > C.
    ratio = log_ratio.exp()  # (N, T) pi_old / pi_sampler
    return ratio.clamp(max=cap), (ratio > cap) & mask.bool()


def _sequence_mask(log_ratio: Tensor, mask: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    log_sequence_ratio = (log_ratio * mask.to(log_ratio.dtype)).sum(1, keepdim=True)  # (N, 1) log prod_t r_t
    out = log_sequence_ratio.abs() > math.log(cap)  # (N, 1): R outside [1/C, C]
    weights = (~out).to(log_ratio.dtype).expand_as(log_ratio)
    return weights, out.expand_as(mask) & mask.bool()


ENGINE_CORRECTIONS: dict[str, Callable[[Tensor, Tensor, float], tuple[Tensor, Tensor]]] = {
    "none": _no_correction,
    "token_tis": _token_tis,
    "sequence_mask": _sequence_mask,
}


@torch.no_grad()
def engine_correction(
    old_logprobs: Tensor, sampled_logprobs: Tensor, mask: Tensor, mode: str, *, cap: float
) -> tuple[Tensor, Tensor]:
    """The correction's per-token weights (N, T), detached, and (N, T) bool: the loss-mask
    tokens whose weight it changed (capped, or in a masked sequence).

    "none":          w_t = 1
    "token_tis":     w_t = min(r_t, C)                           (truncated IS; Yao et al. 2025)
    "sequence_mask": w_t = [1/C <= prod_s r_s <= C] for every t  (sequence rejection)
    with r_t = exp(old_logprobs - sampled_logprobs), the product over the sequence's loss-mask
    tokens. The weights multiply the policy-gradient term; the caller decides what else
    (`sequence_mask` is meant to take a sequence out of the whole loss). C > 1. No gradient
    flows through them: they reweigh the samples, they are not an objective."""
    if cap <= 1.0:
        raise ValueError(f"cap must be > 1, got {cap}")
    try:
        correct = ENGINE_CORRECTIONS[mode]
    except KeyError:
        raise ValueError(f"mode must be one of {sorted(ENGINE_CORRECTIONS)}, got {mode!r}") from None
    return correct(mismatch_log_ratio(old_logprobs, sampled_logprobs, mask), mask, cap)
