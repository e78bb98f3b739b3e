"""Advantages: GRPO's group baseline (outcome and process supervision), PPO's GAE, whitening.

Shapes: N completions, T completion tokens, S reasoning steps, G = group size. The
completions of one prompt are contiguous: rows g*G .. g*G+G-1 form group g.

Deliberate choices where the paper is silent (DeepSeekMath does not define its std):
- std is the unbiased (N-1) one plus `eps`, as TRL (eps 1e-4) and verl (1e-6) do;
- a NaN reward means "could not be scored": it is left out of its group's mean and std and
  its advantage is 0, so it neither pushes nor pulls the policy;
- a group with fewer than two scored outputs has std 0, hence advantage 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["group_advantages", "process_advantages", "gae", "whiten", "ADVANTAGE_SCALES"]


def _nan_mean_std(x: Tensor, dim: int | None = None) -> tuple[Tensor, Tensor]:
    """Mean and unbiased std over the non-NaN entries (std 0 where fewer than two)."""
    valid = ~torch.isnan(x)
    x0 = torch.where(valid, x, torch.zeros_like(x))
    if dim is None:
        count = valid.sum()
        mean = x0.sum() / count.clamp(min=1)
        sq = torch.where(valid, (x - mean) ** 2, torch.zeros_like(x)).sum()
    else:
        count = valid.sum(dim, keepdim=True)
        mean = x0.sum(dim, keepdim=True) / count.clamp(min=1)
        sq = torch.where(valid, (x - mean) ** 2, torch.zeros_like(x)).sum(dim, keepdim=True)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    std = torch.where(count > 1, std, torch.zeros_like(std))
    return mean, std


def _group_std(rewards: Tensor, groups: Tensor) -> Tensor:
    """DeepSeekMath eq. 3: divide by the std of the output's own group."""
    return _nan_mean_std(groups, dim=1)[1]


def _batch_std(rewards: Tensor, groups: Tensor) -> Tensor:
    """Divide by the std of all rewards in the batch (as TRL's `scale_rewards="batch"`)."""
    return _nan_mean_std(rewards)[1].expand(groups.shape[0], 1)


def _no_std(rewards: Tensor, groups: Tensor) -> None:
    """Dr. GRPO (arXiv 2503.20783): no std division, which biases toward easy/hard prompts."""
    return None


# One named function per variant, chosen by name at the edge.
ADVANTAGE_SCALES: dict[str, Callable[[Tensor, Tensor], Tensor | None]] = {
    "group": _group_std,
    "batch": _batch_std,
    "none": _no_std,
}


def group_advantages(rewards: Tensor, group_size: int, *, scale: str = "group", eps: float = 1e-4) -> Tensor:
    """GRPO outcome-supervision advantages, one per completion.

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)      DeepSeekMath §4.1.2, eq. 3

    `rewards` is (N,) with N a multiple of `group_size`; the std is the unbiased one.
    `scale` chooses the divisor: "group" (the paper), "batch" (std of the whole batch) or
    "none" (Dr. GRPO: plain r - mean). NaN rewards are excluded and get advantage 0.
    Returns (N,).
    """
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"scale must be one of {sorted(ADVANTAGE_SCALES)}, got {scale!r}")
    if group_size < 1 or rewards.ndim != 1 or rewards.shape[0] % group_size:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by group_size={group_size}, got shape {tuple(rewards.shape)}"
        )
    groups = rewards.view(-1, group_size)  # (N/G, G)
    group_mean, _ = _nan_mean_std(groups, dim=1)  # (N/G, 1)
    centred = groups - group_mean  # (N/G, G)
    std = ADVANTAGE_SCALES[scale](rewards, groups)  # (N/G, 1) or None
    advantages = centred if std is None else centred / (std + eps)
    return torch.nan_to_num(advantages, nan=0.0).reshape(-1)  # (N,)


def process_advantages(
    step_rewards: Tensor,
    step_ends: Tensor,
    completion_mask: Tensor,
    group_size: int,
    *,
    eps: float = 1e-4,
) -> Tensor:
    """GRPO process-supervision advantages, one per token (DeepSeekMath §4.1.3).

    Every step reward of a group is normalised with the mean and unbiased std of all the
    group's step rewards together:  r~_ij = (r_ij - mean(R_group)) / (std(R_group) + eps).
    Token t of output i then gets the sum of the normalised rewards of the steps that end at
    or after t:  A_it = sum_{j : end(i, j) >= t} r~_ij.

    `step_rewards` (N, S) float, NaN where output i has fewer than S steps.
    `step_ends` (N, S) long, index of the token where step j ends (-1 where absent).
    `completion_mask` (N, T). Returns (N, T), zero where the mask is zero.
    """
    n, t_len = completion_mask.shape
    if step_rewards.shape != step_ends.shape or step_rewards.shape[0] != n or n % group_size:
        raise ValueError(
            "step_rewards and step_ends must both be (N, S), with N the rows of "
            f"completion_mask and a multiple of group_size={group_size}; got "
            f"{tuple(step_rewards.shape)}, {tuple(step_ends.shape)}, {tuple(completion_mask.shape)}"
        )
    present = ~torch.isnan(step_rewards) & (step_ends >= 0)  # (N, S)
    rewards = torch.where(present, step_rewards, torch.full_like(step_rewards, float("nan")))
    groups = rewards.view(n // group_size, -1)  # (N/G, G*S): a group's steps together
    mean, std = _nan_mean_std(groups, dim=1)  # (N/G, 1)
    normalised = ((groups - mean) / (std + eps)).view(n, -1)  # (N, S)
    normalised = torch.where(present, normalised, torch.zeros_like(normalised))
    # Put each step's reward at its end token, then a reversed cumulative sum gives, at t,
    # the sum over steps ending at or after t. Ends past the last column act as ends at it.
    at_end = torch.zeros(n, t_len, dtype=normalised.dtype, device=normalised.device)
    ends = step_ends.clamp(min=0, max=t_len - 1)  # (N, S)
    at_end.scatter_add_(1, ends, normalised)
    advantages = at_end.flip(1).cumsum(1).flip(1)  # (N, T)
    return advantages * completion_mask.to(advantages.dtype)


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2015, arXiv 1506.02438).

    delta_t = r_t + gamma * V_{t'} - V_t,   A_t = delta_t + gamma * lam * A_{t'},
    returns R_t = A_t + V_t, over the tokens the mask marks (the policy's actions), where t'
    is the next marked token after t: a run of unmarked tokens inside a completion (a
    tool's or an environment's output) is skipped, and bootstrapping goes across it, as if
    it were not there. Values (and rewards) past the last marked token count as 0, so its
    delta is r_t - V_t; rewards at unmarked tokens are ignored. With a right-padded mask
    (every completion's tokens, then padding) this is the plain recursion over each row.
    All arguments and both results are (N, T); results are zero where the mask is zero.
    """
    action = mask.bool()  # (N, T)
    mask = mask.to(values.dtype)
    values = values * mask
    rewards = rewards * mask
    t_len = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    next_advantage = torch.zeros_like(rewards[:, 0])  # (N,) A at each row's next action token
    next_value = torch.zeros_like(values[:, 0])  # (N,) V at each row's next action token
    for t in reversed(range(t_len)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = advantage
        # Only an action token moves the recursion on; an unmarked one leaves it as it was.
        next_advantage = torch.where(action[:, t], advantage, next_advantage)
        next_value = torch.where(action[:, t], values[:, t], next_value)
    advantages = advantages * mask
    returns = (advantages + values) * mask
    return advantages, returns


def _identity(x: Tensor) -> Tensor:
    return x


def whiten(
    x: Tensor,
    mask: Tensor,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
    total: Callable[[Tensor], Tensor] = _identity,
) -> Tensor:
    """Masked whitening: (x - mean) / sqrt(var + eps) over the valid entries of the batch.

    The variance is the unbiased one (as TRL's `masked_whiten`). With `shift_mean=False` the
    mean is added back (only the scale changes), as PPO implementations do for advantages
    that should keep their sign balance. Zero where the mask is zero.
    `total` turns a sum over these entries into the sum over the whole batch when the batch
    is split over processes (an all-reduce); by default these entries are the whole batch.
    """
    m = mask.to(x.dtype)
    count = total(m.sum())
    mean = total((x * m).sum()) / count.clamp(min=1)
    var = total((((x - mean) * m) ** 2).sum()) / (count - 1).clamp(min=1)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * m
