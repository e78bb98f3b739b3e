"""The three seams where GRPO and PPO differ (DeepSeekMath §4.1), each a small class.

1. The baseline: `GroupBaseline` (GRPO: (r - group mean) / (group std + eps) for every
   token), `ProcessBaseline` (GRPO §4.1.3: normalised step rewards, summed over the steps
   ending at or after a token), `GAEBaseline` (PPO: GAE against the critic's values).
2. The KL placement of beta * KL(pi_theta || pi_ref): `KLInLoss` (GRPO eq. 3, k3),
   `KLInReward` (PPO eq. 2, k1, per-token reward), `NoKL` (beta = 0, no reference held).
3. The critic: `Critic` (PPO's value model, trained beside the policy) or `NoCritic`.

`build_seams` picks one of each from the config, once; the step calls them without asking
which it has. `BASELINES` and `KL_PLACEMENTS` name the classes; the presets in
`grpo/config/schema.py` say which names each algorithm takes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from grpo.algo import (
    aggregate,
    gae,
    group_advantages,
    kl_estimate,
    kl_penalized_rewards,
    process_advantages,
    value_loss,
    whiten,
)
from grpo.infra.distributed import SingleProcess, World
from grpo.rewards.logged import RewardLog
from grpo.rollout import Rollout
from grpo.rollout.batch import char_to_token_ends
from grpo.train.models import autocast
from grpo.train.layouts import no_grad_pass
from grpo.train.networks import ValueModel, load_value_model

# ---- what flows between the seams -------------------------------------------------------------


@dataclass
class Scored:
    """The rewards of a batch's completions, as a scorer (grpo.train.scorers) gives them."""

    scores: Tensor  # (N,) float: each completion's total, NaN where no reward could score it
    steps: list[list[tuple[int, float]]] | None = None  # process supervision: (end character, reward) per step
    per_function: dict[str, Tensor] = field(default_factory=dict)  # name -> (N,) unweighted scores, NaN where None
    log: RewardLog | None = None  # what the reward functions logged (log_metric, log_extra)

    def select(self, rows: Tensor) -> Scored:
        kept = rows.tolist()
        steps = None if self.steps is None else [self.steps[i] for i in kept]
        log = None if self.log is None else self.log.select(kept)
        return Scored(self.scores[rows], steps, {name: s[rows] for name, s in self.per_function.items()}, log)

    def to(self, device: torch.device | str) -> Scored:
        per_function = {k: v.to(device) for k, v in self.per_function.items()}
        return Scored(self.scores.to(device), self.steps, per_function, self.log)


@dataclass
class Passes:
    """The no-grad passes over a batch before its update."""

    ref_logprobs: Tensor | None  # (N, T) the reference's; None without one (beta = 0)
    old_logprobs: Tensor | None  # (N, T) the policy's as sampled; None when the update can use its own, detached
    old_values: Tensor | None  # (N, T) the critic's; None without one
    old_from_sampler: bool = False  # old_logprobs are the sampler's (train.old_logprobs), not a pass's


@dataclass
class Targets:
    advantages: Tensor  # (N,) per sequence, or (N, T) per token
    returns: Tensor | None = None  # (N, T) what the critic learns to predict; None without one


# ---- 2. the KL placement ----------------------------------------------------------------------


class KLPlacement(Protocol):
    needs_old_logprobs: bool  # whether it reads the sampled policy's log-probs before any update

    def loss_term(self, logprobs: Tensor, ref_logprobs: Tensor | None, mask: Tensor) -> Tensor | float: ...
    def token_rewards(self, scores: Tensor, passes: Passes, mask: Tensor) -> Tensor: ...


def _outcome_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """(N, T): the score at each completion's last token, 0 elsewhere."""
    zeros = torch.zeros_like(mask)
    return kl_penalized_rewards(scores, zeros, zeros, mask, beta=0.0)


class KLInLoss:
    """GRPO (DeepSeekMath eq. 3): + beta * KL per token in the loss; the reward stays the score."""

    needs_old_logprobs = False

    def __init__(self, beta: float, estimator: str):
        self.beta, self.estimator = beta, estimator

    def loss_term(self, logprobs, ref_logprobs, mask):
        return self.beta * kl_estimate(logprobs, ref_logprobs, self.estimator) * mask  # (n, T)

    def token_rewards(self, scores, passes, mask):
        return _outcome_rewards(scores, mask)


class KLInReward:
    """PPO (DeepSeekMath eq. 2, InstructGPT): r_t = score * [t last] - beta * KL_t, with the KL
    of the policy as sampled; nothing in the loss."""

    needs_old_logprobs = True

    def __init__(self, beta: float, estimator: str):
        self.beta, self.estimator = beta, estimator

    def loss_term(self, logprobs, ref_logprobs, mask):
        return 0.0

    def token_rewards(self, scores, passes, mask):
        return kl_penalized_rewards(
            scores, passes.old_logprobs, passes.ref_logprobs, mask, beta=self.beta, kind=self.estimator
        )


class NoKL:
    """beta = 0: no penalty, and no reference to measure a KL against."""

    needs_old_logprobs = False

    def loss_term(self, logprobs, ref_logprobs, mask):
        return 0.0

    def token_rewards(self, scores, passes, mask):
        return _outcome_rewards(scores, mask)


# loss.kl_in -> the placement (beta > 0).
KL_PLACEMENTS: dict[str, Callable[[float, str], KLPlacement]] = {"loss": KLInLoss, "reward": KLInReward}


# ---- 1. the baseline --------------------------------------------------------------------------


class Baseline(Protocol):
    def __call__(self, batch: Rollout, scored: Scored, passes: Passes) -> Targets: ...


class GroupBaseline:
    """GRPO: A_i = (r_i - mean(group)) / (std(group) + eps) for every token of output i.
    Computed on every process's rewards (a few floats each), so that `loss.scale: batch`
    divides by the std of the whole batch, as in one process."""

    def __init__(self, group_size: int, scale: str, eps: float, world: World = SingleProcess()):
        self.group_size, self.scale, self.eps, self.world = group_size, scale, eps, world

    def __call__(self, batch, scored, passes):
        everyone, ours = self.world.gather(scored.scores)  # (N * processes,), our rows from `ours`
        advantages = group_advantages(everyone, self.group_size, scale=self.scale, eps=self.eps)
        return Targets(advantages[ours : ours + len(batch)])


class ProcessBaseline:
    """GRPO with process supervision (DeepSeekMath §4.1.3): step rewards normalised over the
    group; token t's advantage sums the normalised rewards of the steps ending at or after t.
    Steps arrive at character offsets; the tokenizer maps them to tokens. An offset past the
    text (a step the verifier expected but the completion left out: `score_steps`) is the
    completion's last token, its EOS when it has one: the decision to stop pays for what it
    left out, as going on to a wrong step would."""

    def __init__(self, group_size: int, eps: float, tokenizer):
        self.group_size, self.eps, self.tokenizer = group_size, eps, tokenizer

    def __call__(self, batch, scored, passes):
        rewards, ends = self.step_tensors(scored.steps, batch)
        return Targets(process_advantages(rewards, ends, batch.loss_mask, self.group_size, eps=self.eps))

    def step_tensors(self, steps: list[list[tuple[int, float]]], batch: Rollout) -> tuple[Tensor, Tensor]:
        """(N, S) step rewards (NaN where a completion has fewer than S steps) and (N, S) the
        token where each step ends (-1 where absent)."""
        n, width = len(steps), max((len(s) for s in steps), default=0) or 1
        rewards = torch.full((n, width), float("nan"))
        ends = torch.full((n, width), -1, dtype=torch.long)
        lengths = batch.completion_lengths.long().tolist()
        for i, row in enumerate(steps):
            if not row:
                continue
            ids = batch.completion_ids[i, : lengths[i]].tolist()
            token_ends = char_to_token_ends(self.tokenizer, ids, [end for end, _ in row])
            text_end = len(batch.completions[i])
            token_ends = [lengths[i] - 1 if end > text_end else t for (end, _), t in zip(row, token_ends)]
            rewards[i, : len(row)] = torch.tensor([r for _, r in row])
            ends[i, : len(row)] = torch.tensor(token_ends)
        device = batch.completion_mask.device
        return rewards.to(device), ends.to(device)


class GAEBaseline:
    """PPO: per-token rewards (the score at the last token; minus beta * KL per token when the
    KL goes into the reward), then GAE against the critic's values, whitened over the batch."""

    def __init__(
        self, kl: KLPlacement, gamma: float, lam: float, whiten_advantages: bool, world: World = SingleProcess()
    ):
        self.kl, self.gamma, self.lam, self.whiten_advantages = kl, gamma, lam, whiten_advantages
        self.world = world  # whitening's mean and variance are over every process's tokens

    def __call__(self, batch, scored, passes):
        mask = batch.loss_mask  # the policy's actions: GAE bootstraps across the tokens between them
        scores = torch.nan_to_num(scored.scores, nan=0.0)  # an unscorable output teaches nothing
        rewards = self.kl.token_rewards(scores, passes, mask)  # (N, T)
        advantages, returns = gae(rewards, passes.old_values, mask, gamma=self.gamma, lam=self.lam)
        if self.whiten_advantages:
            advantages = whiten(advantages, mask, total=self.world.sum)
        return Targets(advantages, returns)


# ---- 3. the critic ----------------------------------------------------------------------------


class Critic:
    """PPO's value model, trained beside the policy with a clipped value loss."""

    held = 1  # networks it adds to the "models held" count

    def __init__(self, model: ValueModel, *, value_clip: float | None, dtype: torch.dtype | None):
        self.model, self.value_clip, self.dtype = model, value_clip, dtype
        self.networks = [model]

    def param_groups(self, lr: float) -> list[dict]:
        """Its own param group: the optimizer clips it by its own norm, apart from the policy's."""
        return [{"params": list(self.model.parameters()), "lr": lr}]

    def values(self, batch: Rollout, micro_batch_size: int, by_length: bool = False) -> Tensor:
        """(N, T) V(state before each completion token), without autograd (micro-batches
        ordered by length with `by_length`: a group's rows kept together where the critic's
        packed passes share their prompt, else ordered one by one)."""
        with autocast(self.model, self.dtype):
            return no_grad_pass(
                self.model, batch, micro_batch_size, by_length=by_length, whole_groups=self.model.packed
            )

    def loss(self, part: Rollout, rows: Tensor, passes: Passes, targets: Targets, num_tokens: float) -> Tensor:
        """The value loss of the micro-batch `part` (the batch's `rows`, maybe trimmed: the
        per-token tensors are cut to its width), scaled for accumulation."""
        with autocast(self.model, self.dtype):
            values = self.model(part)  # (n, T')
        return value_loss(
            values,
            part.fit(passes.old_values[rows]),
            part.fit(targets.returns[rows]),
            part.loss_mask,
            clip=self.value_clip,
            num_tokens=num_tokens,
        )

    def metrics(self, mean_loss: float, passes: Passes, mask: Tensor, world: World = SingleProcess()) -> dict:
        # The token mean over every process's tokens: each process's share, summed.
        share = aggregate(passes.old_values, mask, "token-mean", num_tokens=float(world.sum(mask.sum())))
        return {"value_loss": mean_loss, "value/mean": float(world.sum(share))}

    def state_dict(self) -> dict:
        return self.model.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state)


class NoCritic:
    """GRPO: no value model. Its loss is 0 and it has nothing to save."""

    held = 0
    networks: list = []

    def param_groups(self, lr: float) -> list[dict]:
        return []

    def values(self, batch: Rollout, micro_batch_size: int, by_length: bool = False) -> None:
        return None

    def loss(self, part: Rollout, rows: Tensor, passes: Passes, targets: Targets, num_tokens: float) -> Tensor:
        return torch.zeros(())  # a 0-dim tensor: adds to a loss on any device

    def metrics(self, mean_loss: float, passes: Passes, mask: Tensor, world: World = SingleProcess()) -> dict:
        return {}

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: None) -> None:
        pass


# ---- choosing, once ---------------------------------------------------------------------------

# (loss.baseline, loss.supervision) -> the baseline, built from the config, the tokenizer and the KL placement.
BASELINES: dict[tuple[str, str], Callable[..., Baseline]] = {
    ("group", "outcome"): lambda c, tokenizer, kl, world: GroupBaseline(
        c.rollout.group_size, c.loss.scale, c.loss.eps, world
    ),
    # Normalised within each group, and a group never spans processes: nothing to share.
    ("group", "process"): lambda c, tokenizer, kl, world: ProcessBaseline(c.rollout.group_size, c.loss.eps, tokenizer),
    ("critic", "outcome"): lambda c, tokenizer, kl, world: GAEBaseline(
        kl, c.loss.gamma, c.loss.lam, c.loss.whiten_advantages, world
    ),
}


def build_kl(c) -> KLPlacement:
    return NoKL() if c.loss.beta == 0 else KL_PLACEMENTS[c.loss.kl_in](c.loss.beta, c.loss.kl_estimator)


def build_baseline(c, tokenizer, kl: KLPlacement, world: World = SingleProcess()) -> Baseline:
    return BASELINES[c.loss.baseline, c.loss.supervision](c, tokenizer, kl, world)


def build_critic(
    c, attention: str | None, dtype: torch.dtype | None, device: torch.device | str = "cpu", world: World | None = None
) -> Critic | NoCritic:
    """The critic the baseline needs: a value model for the critic baseline (PPO), else none.
    The value model is the policy's `model` with a scalar head unless value.model names another;
    its layout is one verdict for every process of `world`."""
    if c.loss.baseline != "critic":
        return NoCritic()
    model = load_value_model(c.value.model or c.model, c.train.dtype, attention, device, c.train.layout, world)
    return Critic(model, value_clip=c.loss.value_clip, dtype=dtype)
