"""One RL step, the same for GRPO and PPO: sample, score, baseline, update.

The algorithms differ in exactly three places, each chosen once when the engine is built:
1. the baseline: `group_baseline` (GRPO) or `critic_baseline` (PPO: value model + GAE);
2. the KL: added to the per-token loss (GRPO) or subtracted from the per-token reward (PPO);
3. the critic: absent (GRPO) or trained beside the policy with a clipped value loss (PPO).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from grpo.algo import (
    aggregate,
    clipped_fraction,
    entropy,
    gae,
    group_advantages,
    kl_estimate,
    kl_penalized_rewards,
    policy_loss,
    process_advantages,
    token_logprobs,
    value_loss,
    whiten,
)
from grpo.infra.memory import peak_memory_mb
from grpo.rewards import StepScores, WeightedReward
from grpo.rollout import Rollout, Sampler
from grpo.rollout.batch import char_to_token_ends
from grpo.train.models import Reference, activation_checkpointing, autocast, completion_logits, policy_logprobs

# ---- the baselines: place 1 (and 2, for where the KL enters the reward) ------------------------


@dataclass
class StepTensors:
    """Process supervision: the step rewards and the token where each step ends."""

    rewards: Tensor  # (N, S) float, NaN where a completion has fewer than S steps
    ends: Tensor  # (N, S) long, token index of each step's end, -1 where absent


@dataclass
class Targets:
    advantages: Tensor  # (N,) per sequence, or (N, T) per token
    returns: Tensor | None = None  # (N, T) for the critic, else None


def group_baseline(scores, steps, batch, old_logprobs, ref_logprobs, old_values, *, group_size, scale, eps, **_) -> Targets:
    """GRPO: A_i = (r_i - mean(group)) / (std(group) + eps) for every token of output i."""
    return Targets(group_advantages(scores, group_size, scale=scale, eps=eps))


def process_baseline(scores, steps, batch, old_logprobs, ref_logprobs, old_values, *, group_size, eps, **_) -> Targets:
    """GRPO with process supervision (DeepSeekMath §4.1.3): step rewards normalised over the
    group; token t's advantage sums the normalised rewards of the steps ending at or after t."""
    return Targets(process_advantages(steps.rewards, steps.ends, batch.completion_mask, group_size, eps=eps))


def critic_baseline(
    scores, steps, batch, old_logprobs, ref_logprobs, old_values, *, beta, kl_estimator, kl_in, gamma, lam, whiten_advantages, **_
) -> Targets:
    """PPO: per-token rewards (score at the last token, minus beta * KL per token when the
    KL goes into the reward), then GAE against the critic's values, whitened."""
    mask = batch.completion_mask
    scores = torch.nan_to_num(scores, nan=0.0)  # an unscorable output teaches nothing
    penalised = kl_in == "reward" and ref_logprobs is not None
    rewards = kl_penalized_rewards(
        scores,
        old_logprobs if penalised else torch.zeros_like(mask),
        ref_logprobs if penalised else torch.zeros_like(mask),
        mask,
        beta=beta if penalised else 0.0,
        kind=kl_estimator,
    )  # (N, T)
    advantages, returns = gae(rewards, old_values, mask, gamma=gamma, lam=lam)
    if whiten_advantages:
        advantages = whiten(advantages, mask)
    return Targets(advantages, returns)


# (loss.baseline, loss.supervision) -> the function that turns rewards into advantages.
BASELINES: dict[tuple[str, str], Callable[..., Targets]] = {
    ("group", "outcome"): group_baseline,
    ("group", "process"): process_baseline,
    ("critic", "outcome"): critic_baseline,
}


# ---- the engine: what a step needs, chosen once from the config --------------------------------


@dataclass
class Engine:
    policy: nn.Module
    tokenizer: object
    sampler: Sampler
    rewards: list[WeightedReward]
    reference: Reference
    critic: nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    score: Callable  # grpo.rewards.score (outcome) or score_steps (process supervision)
    baseline: Callable[..., Targets]
    baseline_kwargs: dict
    prompt_column: str
    temperature: float
    beta: float
    kl_estimator: str
    kl_in_loss: bool
    clip: dict  # clip_low, clip_high, level: the ratio's clipping, for the loss and its diagnostics
    dual_clip: float | None
    aggregation: str
    max_new_tokens: int
    epochs: int
    minibatches: int
    micro_batch_size: int
    max_grad_norm: float
    value_clip: float | None
    drop_zero_std_groups: bool
    group_size: int
    policy_params: list = field(default_factory=list)
    critic_params: list = field(default_factory=list)
    autocast: torch.dtype | None = None  # train.autocast: forward passes in this dtype (None = off)
    checkpointing: bool = False  # train.gradient_checkpointing: recompute layer activations in the backward

    @property
    def needs_old_logprobs(self) -> bool:
        """With one epoch and one minibatch the old policy is the current one (ratio 1), so
        its log-probs are the current ones, detached: no extra forward pass. Otherwise the
        policy moves between updates, and PPO's KL-in-reward needs them before any update."""
        return self.epochs > 1 or self.minibatches > 1 or self.critic is not None


@dataclass
class StepResult:
    metrics: dict
    rollout: Rollout  # everything sampled, including groups left out of the update
    scores: Tensor  # (N,) their rewards


def _groups_with_spread(scores: Tensor, group_size: int) -> Tensor:
    """(N/G,) bool: groups whose scored rewards are not all equal (their advantages move the policy)."""
    groups = scores.view(-1, group_size)
    lo = torch.where(torch.isnan(groups), torch.inf, groups).min(1).values
    hi = torch.where(torch.isnan(groups), -torch.inf, groups).max(1).values
    return hi > lo


def _chunked(forward: Callable[[Rollout], Tensor | None], batch: Rollout, size: int) -> Tensor | None:
    """forward(batch) without autograd, `size` rows at a time (all at once when size is 0).
    In inference mode (no autograd bookkeeping per op); the result is copied out of it, since
    the update's autograd graph uses it."""
    with torch.inference_mode():
        if not size or size >= len(batch):
            out = forward(batch)
        else:
            parts = [forward(batch.select(rows)) for rows in torch.arange(len(batch)).split(size)]
            out = None if parts[0] is None else torch.cat(parts)
    return None if out is None else out.clone()


def _step_tensors(steps: list[list[tuple[int, float]]], batch: Rollout, tokenizer) -> StepTensors:
    """Step rewards at character offsets -> (N, S) rewards and the token where each step ends."""
    n, width = len(steps), max((len(s) for s in steps), default=0) or 1
    rewards = torch.full((n, width), float("nan"))
    ends = torch.full((n, width), -1, dtype=torch.long)
    lengths = batch.completion_lengths.long().tolist()
    for i, row in enumerate(steps):
        if not row:
            continue
        ids = batch.completion_ids[i, : lengths[i]].tolist()
        token_ends = char_to_token_ends(tokenizer, ids, [end for end, _ in row])
        rewards[i, : len(row)] = torch.tensor([r for _, r in row])
        ends[i, : len(row)] = torch.tensor(token_ends)
    device = batch.completion_mask.device
    return StepTensors(rewards.to(device), ends.to(device))


def train_step(e: Engine, rows: list[dict]) -> StepResult:
    """One step on `rows` (prompts_per_step data rows): sample, score, baseline, update."""
    start = time.perf_counter()

    # 1. Sample G completions for each prompt.
    batch = sampled = e.sampler.sample(e.policy, rows)
    lengths = batch.completion_lengths  # (N,) of everything generated, kept or not
    generated = time.perf_counter()

    # 2. Score them; NaN = no reward function could score it. With process supervision a
    #    completion's score is its mean step reward (for the metrics and the group spread).
    prompts = [row[e.prompt_column] for row in batch.rows]
    reward = e.score(e.rewards, prompts, batch.completions, batch.columns(exclude=e.prompt_column))
    scores = reward.total.to(batch.completion_mask.device)  # (N,)
    scored = time.perf_counter()

    # DAPO-style: groups whose rewards are all equal have zero advantage; optionally drop them.
    spread = _groups_with_spread(scores, e.group_size)  # (N/G,)
    keep = torch.arange(len(batch))
    if e.drop_zero_std_groups:
        keep = spread.repeat_interleave(e.group_size).nonzero().squeeze(1)
        batch, scores = batch.select(keep), scores[keep]
    steps = _step_tensors([reward.steps[i] for i in keep.tolist()], batch, e.tokenizer) if isinstance(reward, StepScores) else None

    stats = dict.fromkeys(("loss", "kl", "entropy", "clip_fraction", "grad_norm"))  # nothing to train on
    if len(batch):
        # 3. The reference's (and, if the policy moves before the last update, the old
        #    policy's) log-probs, and the critic's values.
        #    In micro-batches, like the update, so that no pass holds the whole batch's activations.
        with autocast(e.policy, e.autocast):
            ref_logprobs = _chunked(lambda b: e.reference.logprobs(b, e.temperature), batch, e.micro_batch_size)  # (N, T) or None
            old_logprobs = (
                _chunked(lambda b: policy_logprobs(e.policy, b, e.temperature), batch, e.micro_batch_size)
                if e.needs_old_logprobs else None
            )
            old_values = _chunked(e.critic, batch, e.micro_batch_size) if e.critic is not None else None  # (N, T)

        # 4. Advantages: from the group (GRPO) or from the critic (PPO).
        targets = e.baseline(scores, steps, batch, old_logprobs, ref_logprobs, old_values, **e.baseline_kwargs)

        # 5. Update: mu epochs over minibatches, accumulating micro-batches.
        stats = _update(e, batch, targets, old_logprobs, ref_logprobs, old_values)
    updated = time.perf_counter()

    finite = reward.total[~torch.isnan(reward.total)]
    metrics = {
        "reward/mean": float(finite.mean()) if len(finite) else math.nan,
        "reward/std": float(finite.std()) if len(finite) > 1 else 0.0,
        **{f"reward/{name}": float(torch.nanmean(v)) for name, v in reward.per_function.items()},
        **stats,
        "tokens/completion": int(lengths.sum()),
        "tokens/trained": int(batch.completion_lengths.sum()),
        "completion_length/mean": float(lengths.float().mean()),
        "frac_zero_std_groups": float(1.0 - spread.float().mean()),
        "frac_unscored": float(torch.isnan(reward.total).float().mean()),
        "lr": e.scheduler.get_last_lr()[0],
        "time/step": updated - start,
        "time/generate": generated - start,
        "time/score": scored - generated,
        "time/update": updated - scored,
        "memory/peak_mb": peak_memory_mb(),
    }
    return StepResult(metrics, sampled, reward.total)


def _update(e: Engine, batch: Rollout, targets: Targets, old_logprobs, ref_logprobs, old_values) -> dict:
    n = len(batch)
    mask = batch.completion_mask
    sums = {"loss": 0.0, "kl": 0.0, "entropy": 0.0, "clip_fraction": 0.0, "value_loss": 0.0, "grad_norm": 0.0}
    first_pass_tokens = 0.0
    updates = 0
    for epoch in range(e.epochs):
        order = torch.randperm(n) if e.minibatches > 1 else torch.arange(n)
        for minibatch in order.chunk(e.minibatches):
            totals = dict(
                num_sequences=len(minibatch),
                num_tokens=float(mask[minibatch].sum()),
                max_tokens=e.max_new_tokens,
            )
            size = e.micro_batch_size or len(minibatch)
            for micro in minibatch.split(size):
                part = batch.select(micro)
                m = part.completion_mask  # (n, T)
                logits = _policy_logits(e, part)  # (n, T, V)
                logprobs = token_logprobs(logits, part.completion_ids, temperature=e.temperature)  # (n, T)
                old = old_logprobs[micro] if old_logprobs is not None else logprobs.detach()
                advantages = targets.advantages[micro]
                per_token = policy_loss(logprobs, old, advantages, m, **e.clip, dual_clip=e.dual_clip)  # (n, T)
                ref = ref_logprobs[micro] if ref_logprobs is not None else None
                if ref is not None and e.kl_in_loss:
                    # GRPO (DeepSeekMath eq. 3): the KL is a term of the loss, per token.
                    per_token = per_token + e.beta * kl_estimate(logprobs, ref, e.kl_estimator) * m
                loss = aggregate(per_token, m, e.aggregation, **totals)
                if e.critic is not None:
                    with autocast(e.policy, e.autocast):
                        values = e.critic(part)  # (n, T)
                    v_loss = value_loss(
                        values, old_values[micro], targets.returns[micro], m,
                        clip=e.value_clip, num_tokens=totals["num_tokens"],
                    )
                    loss = loss + v_loss
                    sums["value_loss"] += float(v_loss.detach())
                loss.backward()
                sums["loss"] += float(loss.detach())
                if epoch == 0:  # diagnostics of the policy as sampled
                    with torch.no_grad():
                        tokens = float(m.sum())
                        first_pass_tokens += tokens
                        sums["entropy"] += float((entropy(logits.detach(), temperature=e.temperature) * m).sum())
                        if ref is not None:
                            sums["kl"] += float((kl_estimate(logprobs.detach(), ref, e.kl_estimator) * m).sum())
                sums["clip_fraction"] += float(clipped_fraction(logprobs, old, advantages, m, **e.clip)) * len(micro)
            sums["grad_norm"] += _clip(e.policy_params, e.max_grad_norm)
            _clip(e.critic_params, e.max_grad_norm)
            e.optimizer.step()
            e.scheduler.step()
            e.optimizer.zero_grad(set_to_none=True)
            updates += 1
    stats = {
        "loss": sums["loss"] / updates,
        "kl": sums["kl"] / max(first_pass_tokens, 1.0) if ref_logprobs is not None else None,
        "entropy": sums["entropy"] / max(first_pass_tokens, 1.0),
        "clip_fraction": sums["clip_fraction"] / (n * e.epochs),
        "grad_norm": sums["grad_norm"] / updates,
    }
    if e.critic is not None:
        stats["value_loss"] = sums["value_loss"] / updates
        stats["value/mean"] = float(aggregate(old_values, mask, "token-mean"))
    return stats


def _policy_logits(e: Engine, part: Rollout) -> Tensor:
    """The policy's forward for the update: in bf16 under train.autocast (the backward follows
    its dtypes); with checkpointing, in training mode and one pass per row (a checkpointed
    layer recomputes its forward and takes no cache, so the prompts cannot be shared)."""
    with autocast(e.policy, e.autocast), activation_checkpointing(e.policy, e.checkpointing):
        return completion_logits(e.policy, part, share_prompts=not e.checkpointing)


def _clip(params: list, max_norm: float) -> float:
    if not params:
        return 0.0
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    return float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
