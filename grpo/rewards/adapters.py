"""Reward models as reward functions: outcome scores, optional normalisation, process mode.

A `RewardModel` scores prompt + completion; wrapped here it has the same signature as a rule
reward, so the loop mixes neural and rule rewards by weight and counts each model it holds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo.algo import whiten
from grpo.rewards.model import RewardModel
from grpo.rewards.rules import text_of


def _standardise(scores: Tensor) -> Tensor:
    """Whitened over the batch (grpo.algo.whiten): the model's scale is arbitrary, a rule's is 0..1."""
    return whiten(scores.unsqueeze(0), torch.ones(1, scores.numel())).squeeze(0)


class ModelReward:
    """An outcome reward: the reward model's score of each prompt + completion."""

    def __init__(self, model: RewardModel, *, normalize: bool = False):
        self.model = model
        self.normalize = normalize

    def __call__(self, prompts, completions, **columns) -> list[float]:
        scores = self.model.scores(prompts, [text_of(c) for c in completions])  # (N,)
        return (_standardise(scores) if self.normalize else scores).tolist()


def step_ends(completion: str, separator: str) -> list[int]:
    """Character offsets one past each step: after every separator character, and the end."""
    ends = [i + 1 for i, ch in enumerate(completion) if ch in separator]
    if completion and (not ends or ends[-1] != len(completion)):
        ends.append(len(completion))
    return ends


class ProcessModelReward:
    """A process reward model (DeepSeekMath §4.1.3, its neural form): the reward model's score
    of the prefix that ends at each step, one (end, score) per step."""

    def __init__(self, model: RewardModel, *, separator: str = "\n", normalize: bool = False):
        self.model = model
        self.separator = separator
        self.normalize = normalize

    def __call__(self, prompts, completions, **columns) -> list[list[tuple[int, float]] | None]:
        completions = [text_of(c) for c in completions]  # TRL's conversational form: its text
        ends = [step_ends(c, self.separator) for c in completions]
        scores = self.model.score_steps(prompts, completions, ends)  # per completion, per step
        if self.normalize:
            flat = iter(_standardise(torch.tensor([s for row in scores for s in row], dtype=torch.float32)).tolist())
            scores = [[next(flat) for _ in row] for row in scores]
        return [list(zip(e, s)) or None for e, s in zip(ends, scores)]
